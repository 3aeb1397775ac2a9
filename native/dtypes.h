// Element types the fusion core understands, and exact fp16/bf16 conversions.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace rtx {

enum class DType : int { Float32, Float64, Float16, BFloat16, Int32, Int64, Int8, UInt8 };

inline std::size_t itemsize(DType t) {
    switch (t) {
        case DType::Float64: case DType::Int64: return 8;
        case DType::Float32: case DType::Int32: return 4;
        case DType::Float16: case DType::BFloat16: return 2;
        default: return 1;
    }
}

inline const char *dtype_name(DType t) {
    switch (t) {
        case DType::Float32: return "float32";
        case DType::Float64: return "float64";
        case DType::Float16: return "float16";
        case DType::BFloat16: return "bfloat16";
        case DType::Int32: return "int32";
        case DType::Int64: return "int64";
        case DType::Int8: return "int8";
        default: return "uint8";
    }
}

// Returns false when the name is not a supported dtype.
bool dtype_from_name(const std::string &name, DType &out);

inline bool is_floating(DType t) {
    return t == DType::Float32 || t == DType::Float64 || t == DType::Float16 ||
           t == DType::BFloat16;
}

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// IEEE half <-> single, round to nearest even (same results as torch's .half()).
inline float half_to_float(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result =
        sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
    return f32_from_bits(result);
}

inline uint16_t float_to_half(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_float(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace rtx
