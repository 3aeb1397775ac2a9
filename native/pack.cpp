#include "pack.h"

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

namespace rtx {
namespace {

constexpr std::size_t kParallelBytes = 1 << 20;  // below this, threads cost more than they save
int g_threads = 0;

template <typename T>
void scale_copy(const T *src, T *dst, std::size_t n, double scale) {
    const T s = static_cast<T>(scale);
    for (std::size_t i = 0; i < n; ++i) dst[i] = src[i] * s;
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void scale_copy16(const uint16_t *src, uint16_t *dst, std::size_t n, float s) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = FromF(ToF(src[i]) * s);
}

template <uint16_t (*FromF)(float)>
void narrow(const float *src, uint16_t *dst, std::size_t n, float s) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = FromF(src[i] * s);
}

template <float (*ToF)(uint16_t)>
void widen(const uint16_t *src, float *dst, std::size_t n, float s) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = ToF(src[i]) * s;
}

void copy_one(const void *src, void *dst, std::size_t n, DType from, DType to, double scale) {
    if (n == 0) return;
    if (from == to) {
        if (scale == 1.0) {
            std::memcpy(dst, src, n * itemsize(from));
            return;
        }
        const float fs = static_cast<float>(scale);
        switch (from) {
            case DType::Float32:
                return scale_copy(static_cast<const float *>(src), static_cast<float *>(dst), n, scale);
            case DType::Float64:
                return scale_copy(static_cast<const double *>(src), static_cast<double *>(dst), n, scale);
            case DType::Float16:
                return scale_copy16<half_to_float, float_to_half>(
                    static_cast<const uint16_t *>(src), static_cast<uint16_t *>(dst), n, fs);
            case DType::BFloat16:
                return scale_copy16<bf16_to_float, float_to_bf16>(
                    static_cast<const uint16_t *>(src), static_cast<uint16_t *>(dst), n, fs);
            default:
                return;  // integer scaling is rejected before we get here
        }
    }
    const float fs = static_cast<float>(scale);
    if (from == DType::Float32 && to == DType::Float16)
        return narrow<float_to_half>(static_cast<const float *>(src), static_cast<uint16_t *>(dst), n, fs);
    if (from == DType::Float32 && to == DType::BFloat16)
        return narrow<float_to_bf16>(static_cast<const float *>(src), static_cast<uint16_t *>(dst), n, fs);
    if (from == DType::Float16 && to == DType::Float32)
        return widen<half_to_float>(static_cast<const uint16_t *>(src), static_cast<float *>(dst), n, fs);
    if (from == DType::BFloat16 && to == DType::Float32)
        return widen<bf16_to_float>(static_cast<const uint16_t *>(src), static_cast<float *>(dst), n, fs);
}

// Runs the element range [begin, end) of the concatenated segments.
void copy_range(const std::vector<Segment> &segs, std::size_t begin, std::size_t end, DType from,
                DType to, double scale) {
    const std::size_t in_size = itemsize(from), out_size = itemsize(to);
    std::size_t pos = 0;
    for (const Segment &s : segs) {
        const std::size_t seg_begin = pos, seg_end = pos + s.count;
        pos = seg_end;
        if (seg_end <= begin) continue;
        if (seg_begin >= end) break;
        const std::size_t lo = std::max(begin, seg_begin) - seg_begin;
        const std::size_t hi = std::min(end, seg_end) - seg_begin;
        copy_one(static_cast<const char *>(s.src) + lo * in_size,
                 static_cast<char *>(s.dst) + lo * out_size, hi - lo, from, to, scale);
    }
}

}  // namespace

int default_threads() {
    const unsigned hw = std::thread::hardware_concurrency();
    return static_cast<int>(std::clamp(hw == 0 ? 1u : hw, 1u, 8u));
}

int get_num_threads() { return g_threads > 0 ? g_threads : default_threads(); }

void set_num_threads(int n) { g_threads = n; }

void copy_segments(const std::vector<Segment> &segments, DType from, DType to, double scale,
                   int threads) {
    std::size_t total = 0;
    for (const Segment &s : segments) total += s.count;
    const std::size_t bytes = total * std::max(itemsize(from), itemsize(to));
    if (threads <= 1 || bytes < kParallelBytes) {
        copy_range(segments, 0, total, from, to, scale);
        return;
    }
    const std::size_t parts = static_cast<std::size_t>(threads);
    // Chunks end on 64-byte boundaries of the output so threads never share a cache line.
    const std::size_t align = std::max<std::size_t>(1, 64 / itemsize(to));
    const std::size_t chunk = ((total + parts - 1) / parts + align - 1) / align * align;
    std::vector<std::thread> pool;
    pool.reserve(parts - 1);
    std::size_t done_by_pool = std::min(total, chunk);  // this thread copies the rest
    try {
        for (std::size_t p = 1; p < parts; ++p) {
            const std::size_t b = std::min(total, p * chunk), e = std::min(total, (p + 1) * chunk);
            if (b < e) pool.emplace_back(copy_range, std::cref(segments), b, e, from, to, scale);
            done_by_pool = e;
        }
    } catch (const std::system_error &) {
        // no thread to be had (a process at its limit): this thread copies what the pool
        // did not take, rather than std::terminate on the joinable threads' destructors
    }
    copy_range(segments, 0, std::min(total, chunk), from, to, scale);
    if (done_by_pool < total) copy_range(segments, done_by_pool, total, from, to, scale);
    for (std::thread &t : pool) t.join();
}

}  // namespace rtx
