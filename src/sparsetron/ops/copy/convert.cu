#include <cuda_bf16.h>

#include "sparsetron/core/cuda_check.h"
#include "sparsetron/ops/copy/copy.h"

namespace sparsetron::cuda {
namespace {

// __float2bfloat16_rn rounds to nearest even, matching the CPU's float_to_bf16.
__global__ void f32_to_bf16_kernel(const float* src, __nv_bfloat16* dst, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void bf16_to_f32_kernel(const __nv_bfloat16* src, float* dst, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

}  // namespace

void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst) {
    int64_t n = src.numel();
    if (n == 0) return;
    auto stream = static_cast<cudaStream_t>(ctx.stream);
    int threads = 256;
    int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 65535));
    if (src.dtype == DType::F32 && dst.dtype == DType::BF16) {
        f32_to_bf16_kernel<<<blocks, threads, 0, stream>>>(
            static_cast<const float*>(src.data), static_cast<__nv_bfloat16*>(dst.data), n);
    } else if (src.dtype == DType::BF16 && dst.dtype == DType::F32) {
        bf16_to_f32_kernel<<<blocks, threads, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(src.data), static_cast<float*>(dst.data), n);
    } else {
        throw Error(cat("convert (cuda): unsupported ", dtype_name(src.dtype), " -> ",
                        dtype_name(dst.dtype)));
    }
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
