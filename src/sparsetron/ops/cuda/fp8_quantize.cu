// FP8 blockwise quantization on the device (the CPU reference is ops/cpu/fp8_blockwise.h, which
// these kernels match bit for bit): one fp32 scale per 1x128 block of an activation row and per
// 128x128 block of a weight, e4m3 with round-to-nearest-even and saturation to +-448
// (__NV_SATFINITE), scales by Transformer Engine's rule with correctly rounded divisions, so
// the result does not depend on fast-math flags. The scales are written where cuBLASLt's
// block-scaled GEMM reads them (ops/fp8_scale_layout.h).
#include <cuda_fp8.h>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/ops.h"
#include "sparsetron/ops/fp8_scale_layout.h"

namespace sparsetron::cuda {
namespace {

constexpr int kBlock = 128;

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

// One warp per (row, 128-column block), 8 blocks to a CTA: a lane holds 4 consecutive values
// (one 8-byte load when the row allows it), the block's amax is a warp reduction, the 4 codes
// leave as one 4-byte store. The first version (a 128-thread CTA per block, a CTA-wide
// reduction) moved 620 GB/s on the H200; this one is bandwidth-bound (docs/perf).
__global__ void quantize_1x128_kernel(const bf* x, int64_t rows, int64_t cols, int64_t ld,
                                      bool pow2, bool vec, uint8_t* q, float* scale_inv) {
    const int64_t nb = (cols + kBlock - 1) / kBlock;
    const int64_t unit = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (unit >= rows * nb) return;
    const int lane = threadIdx.x & 31;
    const int64_t r = unit / nb, b = unit % nb, c = b * kBlock + lane * 4;
    float v[4];
    if (vec && c + 3 < cols) {
        const uint2 raw = *reinterpret_cast<const uint2*>(x + r * ld + c);
        const bf* h = reinterpret_cast<const bf*>(&raw);
        for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(h[i]);
    } else {
        for (int i = 0; i < 4; ++i) v[i] = c + i < cols ? __bfloat162float(x[r * ld + c + i]) : 0.f;
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    const float s = scale_from_amax(warp_max(amax), pow2);
    uint8_t out[4];
    for (int i = 0; i < 4; ++i) out[i] = to_e4m3(v[i] * s);
    if (vec && c + 3 < cols) {
        *reinterpret_cast<uint32_t*>(q + r * cols + c) = uint32_t(out[0]) | uint32_t(out[1]) << 8 |
                                                         uint32_t(out[2]) << 16 |
                                                         uint32_t(out[3]) << 24;
    } else {
        for (int i = 0; i < 4; ++i)
            if (c + i < cols) q[r * cols + c + i] = out[i];
    }
    if (lane == 0) scale_inv[fp8::scale_index_1x128(r, b, rows)] = __fdiv_rn(1.f, s);
}

// One block of 256 threads per 128x128 tile.
__global__ void quantize_128x128_kernel(const float* w, int64_t rows, int64_t cols, bool pow2,
                                        uint8_t* q, float* scale_inv) {
    const int64_t r0 = int64_t(blockIdx.x) * kBlock, c0 = int64_t(blockIdx.y) * kBlock;
    float amax = 0.f;
    for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
        const int64_t r = r0 + i / kBlock, c = c0 + i % kBlock;
        if (r < rows && c < cols) amax = fmaxf(amax, fabsf(w[r * cols + c]));
    }
    const float s = scale_from_amax(block_max(amax), pow2);
    for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
        const int64_t r = r0 + i / kBlock, c = c0 + i % kBlock;
        if (r < rows && c < cols) q[r * cols + c] = to_e4m3(w[r * cols + c] * s);
    }
    if (threadIdx.x == 0)
        scale_inv[fp8::scale_index_128x128(blockIdx.x, blockIdx.y, cols)] = __fdiv_rn(1.f, s);
}

}  // namespace

void quantize_fp8_1x128(const ExecContext& ctx, const bf16* x, int64_t rows, int64_t cols,
                        int64_t ld, bool pow2, uint8_t* q, float* scale_inv) {
    if (rows == 0 || cols == 0) return;
    const int64_t units = rows * ((cols + kBlock - 1) / kBlock);
    // Vector loads and stores need 8-byte aligned rows of x and 4-byte aligned rows of q.
    const bool vec = cols % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(q) % 4 == 0;
    quantize_1x128_kernel<<<unsigned((units + 7) / 8), 256, 0, stream_of(ctx)>>>(
        dev(x), rows, cols, ld, pow2, vec, q, scale_inv);
    ST_CUDA_LAUNCH_CHECK();
}

void quantize_fp8_128x128(const ExecContext& ctx, const float* w, int64_t rows, int64_t cols,
                          bool pow2, uint8_t* q, float* scale_inv) {
    if (rows == 0 || cols == 0) return;
    const int64_t rb = (rows + kBlock - 1) / kBlock, cb = (cols + kBlock - 1) / kBlock;
    quantize_128x128_kernel<<<dim3(unsigned(rb), unsigned(cb)), 256, 0, stream_of(ctx)>>>(
        w, rows, cols, pow2, q, scale_inv);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
