// A persistent, aligned, growable byte buffer that fused collectives reuse every step.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtypes.h"

namespace rtx {

class FusionBuffer {
public:
    static constexpr std::size_t kAlignment = 64;

    FusionBuffer(DType dtype, std::size_t initial_bytes);
    ~FusionBuffer();
    FusionBuffer(const FusionBuffer &) = delete;
    FusionBuffer &operator=(const FusionBuffer &) = delete;

    // Makes room for at least `nbytes`; grows geometrically so steady state never allocates.
    // Growing invalidates earlier views; contents are not kept.
    void reserve(std::size_t nbytes);

    DType dtype() const { return dtype_; }
    std::size_t capacity_bytes() const { return capacity_; }
    std::size_t capacity_elements() const { return capacity_ / itemsize(dtype_); }
    std::uint64_t allocations() const { return allocations_; }
    void *data() { return data_; }

private:
    DType dtype_;
    void *data_ = nullptr;
    std::size_t capacity_ = 0;
    std::uint64_t allocations_ = 0;
};

}  // namespace rtx
