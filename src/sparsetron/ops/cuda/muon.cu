// Muon's momentum and decoupled decay on the device (the batched Newton-Schulz: muon_batch.cu).
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/ops.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void momentum_kernel(float* w, const float* g, float* mom, int64_t n, float decay,
                                float beta, const float* scale, const int32_t* skip,
                                const float* lr, float weight_decay) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n || (skip && *skip)) return;
    w[i] *= lr ? 1.f - *lr * weight_decay : decay;
    mom[i] = beta * mom[i] + (1.f - beta) * g[i] * (scale ? *scale : 1.f);
}

}  // namespace

void muon_momentum(const ExecContext& ctx, float* w, const float* g, float* mom, int64_t n,
                   float decay, float beta, const float* scale, const int32_t* skip,
                   const float* lr, float weight_decay) {
    if (n == 0) return;
    momentum_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
        w, g, mom, n, decay, beta, scale, skip, lr, weight_decay);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
