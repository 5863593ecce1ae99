// The device side of FP8 blockwise quantization shared by the quantizers (fp8_quantize.cu) and
// the kernels that write an FP8 copy of their bf16 output (the MoE producers): Transformer
// Engine's scale rule with correctly rounded divisions, e4m3 with saturation, and one 1x128 block
// held by a half-warp. Bit for bit the CPU reference (ops/fp8/fp8.h).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "sparsetron/ops/common/fp8_scale_layout.h"

namespace sparsetron::cuda::fp8_dev {

__device__ __forceinline__ float scale_from_amax(float amax, bool pow2) {
    if (!(amax > 0.f) || !isfinite(amax)) return 1.f;
    float scale = __fdiv_rn(448.f, amax);
    if (!isfinite(scale)) scale = 3.402823466e38f;
    if (pow2) {
        int e = 0;
        frexpf(scale, &e);
        scale = ldexpf(1.f, e - 1);
    }
    return scale;
}

__device__ __forceinline__ uint8_t to_e4m3(float v) {
    return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint32_t pack4(const uint8_t (&b)[4]) {
    return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
}

// One 1x128 block held by the 16 lanes of a half-warp (1D thread blocks, blockDim a multiple of
// 32), lane `threadIdx.x & 15` holding the block's columns 8 lane .. 8 lane + 7 in v (zeros past
// a partial block's end): the block's amax by shuffles inside the half-warp (its 16 lanes must
// all be here; the other half may have left), the lane's 8 codes (little-endian: column order)
// and the block's scale inverse, for the caller to store.
struct HalfWarpBlock {
    uint2 codes;
    float scale_inv;
};
__device__ __forceinline__ HalfWarpBlock quantize_half_warp_block(const float (&v)[8], bool pow2) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
    const unsigned half = 0xffffu << (threadIdx.x & 16);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half, amax, o));
    const float s = scale_from_amax(amax, pow2);
    uint8_t b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = to_e4m3(v[j] * s);
    return {make_uint2(pack4({b[0], b[1], b[2], b[3]}), pack4({b[4], b[5], b[6], b[7]})),
            __fdiv_rn(1.f, s)};
}

// The FP8 copy of 16-byte chunk `chunk` (8 bf16, values v) of row r of a [rows, cols] tensor
// (cols a multiple of 128: a block is 16 whole chunks), written by the half-warp holding the
// block: codes at q + 8 * (r * cols / 8 + chunk), the scale at the GEMM layout's entry.
__device__ __forceinline__ void store_row_chunk_fp8(const float (&v)[8], bool pow2, int64_t r,
                                                    int64_t chunk, int64_t cols, int64_t rows,
                                                    uint8_t* q, float* scale_inv) {
    const HalfWarpBlock b = quantize_half_warp_block(v, pow2);
    *reinterpret_cast<uint2*>(q + r * cols + chunk * 8) = b.codes;
    if ((threadIdx.x & 15) == 0)
        scale_inv[fp8::scale_index_1x128(r, chunk / 16, rows)] = b.scale_inv;
}

}  // namespace sparsetron::cuda::fp8_dev
