#include "fusion_buffer.h"

#include <cstdlib>
#include <new>

namespace rtx {

FusionBuffer::FusionBuffer(DType dtype, std::size_t initial_bytes) : dtype_(dtype) {
    if (initial_bytes > 0) reserve(initial_bytes);
}

FusionBuffer::~FusionBuffer() { std::free(data_); }

void FusionBuffer::reserve(std::size_t nbytes) {
    if (nbytes <= capacity_) return;
    std::size_t grown = capacity_ + capacity_ / 2;
    std::size_t want = nbytes > grown ? nbytes : grown;
    want = (want + kAlignment - 1) / kAlignment * kAlignment;
    void *fresh = std::aligned_alloc(kAlignment, want);
    if (fresh == nullptr) throw std::bad_alloc();
    std::free(data_);
    data_ = fresh;
    capacity_ = want;
    ++allocations_;
}

}  // namespace rtx
