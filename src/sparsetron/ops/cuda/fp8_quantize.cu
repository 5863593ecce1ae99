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

// One block of 128 threads per (row, 128-column block).
__global__ void quantize_1x128_kernel(const bf* x, int64_t rows, int64_t cols, int64_t ld,
                                      bool pow2, uint8_t* q, float* scale_inv) {
    const int64_t r = blockIdx.x, b = blockIdx.y, c = b * kBlock + threadIdx.x;
    const float v = c < cols ? __bfloat162float(x[r * ld + c]) : 0.f;
    const float s = scale_from_amax(block_max(fabsf(v)), pow2);
    if (c < cols) q[r * cols + c] = to_e4m3(v * s);
    if (threadIdx.x == 0) scale_inv[fp8::scale_index_1x128(r, b, rows)] = __fdiv_rn(1.f, s);
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
    const int64_t nb = (cols + kBlock - 1) / kBlock;
    quantize_1x128_kernel<<<dim3(unsigned(rows), unsigned(nb)), kBlock, 0, stream_of(ctx)>>>(
        dev(x), rows, cols, ld, pow2, q, scale_inv);
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
