// FP8 blockwise scaling (SPEC §6, `fp8_recipe: blockwise`): e4m3 values with one
// fp32 scale per 1x128 block of an activation row (along the contraction dimension) and per
// 128x128 block of a weight, the DeepSeek-V3 recipe that cuBLASLt's block-scaled GEMM runs on
// Hopper (scale modes VEC128_32F and BLK128x128_32F). CPU reference: fp8_cpu.cpp, which the
// CUDA quantizers (fp8_quantize.cu) match bit for bit; CUDA GEMMs: gemm_fp8.cu (cuBLASLt); the
// routed experts' FP8 grouped GEMM is the moe family's (moe.h). Scale layouts: scale_layout.h.
// Tests: tests/ops/test_fp8.cpp, tests/gpu/ops/test_fp8_cuda.cpp.
//
// Scales follow Transformer Engine's rule: scale = 448 / amax of the block (1 when amax is 0 or
// not finite), optionally rounded down to a power of two (`pow2`, TE's default for blockwise);
// q = e4m3(x * scale) with round-to-nearest-even and saturation to +-448; the stored factor is
// scale_inv = 1 / scale, so x ~ e4m3_to_float(q) * scale_inv.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"

namespace sparsetron::cpu {

constexpr int kFp8Block = 128;
constexpr float kE4m3Max = 448.f;
// The blockwise recipe's scales are rounded down to powers of two (Transformer Engine's default):
// what the engine's quantizers are called with, CPU and CUDA.
constexpr bool kFp8Pow2Scales = true;

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

namespace sparsetron::cuda {

// An FP8 copy written beside a bf16 output by the kernels that produce the routed experts' GEMM
// inputs: the 1x128 quantization of the bf16 rows as written (bit for bit quantize_fp8_1x128 of
// them), scales in the GEMM layout of `rows` rows (the buffer's row capacity). q == nullptr:
// none. Fused where the rows are whole 128-column blocks and 16-byte aligned; otherwise the bf16
// kernel then quantize_fp8_1x128 over the buffer (same bytes).
struct Fp8RowsOut {
    uint8_t* q = nullptr;
    float* scale_inv = nullptr;
    int64_t rows = 0;
    bool pow2 = true;
};

// Quantizers (fp8_quantize.cu; bit for bit the CPU reference above): e4m3 q and fp32 scale_inv (x ~
// q * scale_inv), the scales in the GEMM's layout (scale_layout.h: fp8::scales_1x128 /
// scales_128x128 floats). Activations x [rows, cols] bf16 (row stride ld), one scale per 1x128
// block of a row.
void quantize_fp8_1x128(const ExecContext& ctx, const bf16* x, int64_t rows, int64_t cols,
                        int64_t ld, bool pow2, uint8_t* q, float* scale_inv);
// Weights w [rows, cols] fp32 (the masters: quantized from full precision), 128x128 blocks.
// `transposed`: q and scale_inv are those of w^T [cols, rows] (the input-gradient GEMM's operand;
// bit for bit the quantization of w^T).
void quantize_fp8_128x128(const ExecContext& ctx, const float* w, int64_t rows, int64_t cols,
                          bool pow2, uint8_t* q, float* scale_inv, bool transposed = false);
// Both at once (one read of w): q, scale_inv as the plain call, qt, scale_inv_t as transposed.
// With `count` > 1: `count` matrices, w's `w_stride` elements apart (a layer's experts: one
// parameter stride apart in the masters), their outputs packed matrix after matrix (q and qt
// rows x cols apart, the scales fp8::scales_128x128 of their shapes apart), in one launch.
void quantize_fp8_128x128_both(const ExecContext& ctx, const float* w, int64_t rows, int64_t cols,
                               bool pow2, uint8_t* q, float* scale_inv, uint8_t* qt,
                               float* scale_inv_t, int64_t count = 1, int64_t w_stride = 0);
// 1x128 blocks down the columns of x [rows, cols] bf16 (row stride ld), written as the operand
// x^T [cols, rows] (rows contiguous) with its 1x128 scales: the weight gradient's operands, whose
// contraction runs over rows (tokens). Bit for bit quantize_fp8_1x128 of x^T.
void quantize_fp8_1x128_columns(const ExecContext& ctx, const bf16* x, int64_t rows, int64_t cols,
                                int64_t ld, bool pow2, uint8_t* q, float* scale_inv);

// The routed experts' weight-gradient operands: x [rows, cols] bf16 (row stride ld) holds the
// experts' rows in order (expert e's rows [offsets[e], offsets[e + 1]), offsets on the device),
// written as x^T [cols, padded] quantized in 1x128 blocks down the columns per expert: expert e's
// segment starts at the sum of the earlier experts' row counts rounded up to 128 each and is
// zero-padded to a multiple of 128, so no block holds two experts' rows (a scale over two
// experts' rows would lose the smaller ones). Scales in the 1x128 layout of [cols, padded];
// entries past the last segment are not written. `padded` (a multiple of 128) at least
// fp8::expert_columns_padded(rows, experts).
void quantize_fp8_1x128_expert_columns(const ExecContext& ctx, const bf16* x,
                                       const int32_t* offsets, int64_t experts, int64_t cols,
                                       int64_t ld, int64_t padded, bool pow2, uint8_t* q,
                                       float* scale_inv);

// Block-scaled GEMM (gemm_fp8.cu, cuBLASLt on Hopper): y [m, n] bf16 (row stride
// ldy) = x [m, k] w [n, k]^T (+ y when accumulate), both e4m3 with k contiguous and their scales
// in the GEMM layout; x has 1x128 scales, w 1x128 or 128x128 (not both 128x128: cuBLASLt
// rejects 2D x 2D). k and ldy multiples of 16. Products in fp32 with the scales applied per
// 128-wide block of k (no fast accumulation).
struct Fp8Operand {
    const uint8_t* q = nullptr;
    const float* scale_inv = nullptr;
    bool blocks_128x128 = false;  // false: 1x128
};
void gemm_fp8_blockwise(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, Fp8Operand x,
                        Fp8Operand w, bf16* y, int64_t ldy, bool accumulate = false);
// The same with an fp32 y (weight gradients accumulated into the fp32 gradient).
void gemm_fp8_blockwise(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, Fp8Operand x,
                        Fp8Operand w, float* y, int64_t ldy, bool accumulate = false);

}  // namespace sparsetron::cuda
