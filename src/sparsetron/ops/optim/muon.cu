// Muon's momentum on the device (the batched Newton-Schulz, the decoupled decay and the update:
// muon_batch.cu).
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/optim/optim.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void momentum_kernel(const float* g, float* mom, int64_t n, float beta,
                                const float* scale, const int32_t* skip) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n || (skip && *skip)) return;
    mom[i] = beta * mom[i] + (1.f - beta) * g[i] * (scale ? *scale : 1.f);
}

}  // namespace

void muon_momentum(const ExecContext& ctx, const float* g, float* mom, int64_t n, float beta,
                   const float* scale, const int32_t* skip) {
    if (n == 0) return;
    momentum_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(g, mom, n, beta,
                                                                              scale, skip);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
