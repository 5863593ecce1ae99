// FP8 blockwise scaling, the CPU reference (SPEC §6, `fp8_recipe: blockwise`): e4m3 values with one
// fp32 scale per 1x128 block of an activation row (along the contraction dimension) and per
// 128x128 block of a weight, the DeepSeek-V3 recipe that cuBLASLt's block-scaled GEMM runs on
// Hopper (scale modes VEC128_32F and BLK128x128_32F). The CUDA quantizers and the FP8 GEMM path
// are checked against these functions.
//
// Scales follow Transformer Engine's rule: scale = 448 / amax of the block (1 when amax is 0 or
// not finite), optionally rounded down to a power of two (`pow2`, TE's default for blockwise);
// q = e4m3(x * scale) with round-to-nearest-even and saturation to +-448; the stored factor is
// scale_inv = 1 / scale, so x ~ e4m3_to_float(q) * scale_inv.
#pragma once

#include <cstdint>

namespace sparsetron::cpu {

constexpr int kFp8Block = 128;
constexpr float kE4m3Max = 448.f;

// e4m3 ("fn": no infinities; 0x7F / 0xFF are NaN): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
float e4m3_to_float(uint8_t code);
// Round to nearest even, saturating to +-448; NaN -> 0x7F.
uint8_t e4m3_from_float(float x);

// The scale for a block of absolute maximum `amax`.
float fp8_scale_from_amax(float amax, bool pow2);

// x [rows, cols] (row stride ld) -> q [rows, cols], scale_inv [rows, ceil(cols / 128)]:
// one scale per 128 consecutive columns of a row (activations, contraction along columns).
void quantize_1x128(const float* x, int64_t rows, int64_t cols, int64_t ld, bool pow2, uint8_t* q,
                    float* scale_inv);
// w [rows, cols] -> q [rows, cols], scale_inv [ceil(rows / 128), ceil(cols / 128)] (weights).
void quantize_128x128(const float* w, int64_t rows, int64_t cols, bool pow2, uint8_t* q,
                      float* scale_inv);

// y [m, n] = x w^T from quantized operands, the way a block-scaled GEMM computes it: for every
// 128-wide block kb of the contraction, the e4m3 products summed (in double here) and scaled by
// sx[m, kb] * sw[n / 128, kb]. x: [m, k] with 1x128 scales, w: [n, k] with 128x128 scales, or
// with `w_1x128` 1x128 scales too (sw [n, blocks(k)], scaled by sw[n, kb]): the weight gradient's
// form, dW = dy^T x with both operands quantized along the tokens.
void gemm_fp8_blockwise(const uint8_t* qx, const float* sx, const uint8_t* qw, const float* sw,
                        int64_t m, int64_t n, int64_t k, float* y, bool w_1x128 = false);

}  // namespace sparsetron::cpu
