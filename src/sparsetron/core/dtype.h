// Element types and bf16 conversion with round-to-nearest-even.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace sparsetron {

// F16 (IEEE half) is a device compute type only (the Gram form of Muon's Newton-Schulz runs its
// products in it); tensors and checkpoints never hold it. F8E4M3 is read from released FP8
// checkpoints (dequantized on load), never planned.
enum class DType : uint8_t { F32, F64, BF16, I32, I64, U8, F16, F8E4M3 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses the names used in safetensors headers ("F32", "BF16", ...).
DType dtype_from_safetensors(const std::string& name);
const char* dtype_safetensors_name(DType t);

// bfloat16 storage: the upper 16 bits of an IEEE float.
struct bf16 {
    uint16_t bits = 0;
};

// Round-to-nearest-even; NaN stays a (quiet) NaN, overflow rounds to +-inf as IEEE requires.
inline bf16 float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
        return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // keep NaN a NaN
    }
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float bf16_to_float(bf16 h) {
    uint32_t u = static_cast<uint32_t>(h.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
    return DType::F32;
}
template <>
constexpr DType dtype_of<double>() {
    return DType::F64;
}
template <>
constexpr DType dtype_of<bf16>() {
    return DType::BF16;
}
template <>
constexpr DType dtype_of<int32_t>() {
    return DType::I32;
}
template <>
constexpr DType dtype_of<int64_t>() {
    return DType::I64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
    return DType::U8;
}

}  // namespace sparsetron
