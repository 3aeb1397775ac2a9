// Copy many tensors into / out of one contiguous buffer, scaling and casting in the same pass.
#pragma once

#include <cstddef>
#include <vector>

#include "dtypes.h"

namespace rtx {

struct Segment {
    const void *src;
    void *dst;
    std::size_t count;  // elements
};

// Copies every segment converting `from` -> `to` and multiplying by `scale`.
// Large batches are split by bytes across `threads` worker threads.
void copy_segments(const std::vector<Segment> &segments, DType from, DType to, double scale,
                   int threads);

int default_threads();
int get_num_threads();
void set_num_threads(int n);

}  // namespace rtx
