// The optimizer's device kernels (optim.h): the gradient norm's fixed-order partial sums, the
// clipping scale and skip flags as device scalars, and AdamW (lr and bias corrections from a
// device schedule inside a captured step).
#include <cmath>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/optim/optim.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kSquaresBlock = 8192;  // elements per partial sum of the gradient norm

// A gradient element as fp32: fp32 gradients, or bf16 gradient buffers.
__device__ __forceinline__ float grad_value(float x) {
    return x;
}
__device__ __forceinline__ float grad_value(bf x) {
    return __bfloat162float(x);
}

template <typename G>
__global__ void sum_squares_kernel(const G* x, int64_t n, float* partials) {
    const int64_t b0 = blockIdx.x * int64_t(kSquaresBlock), b1 = min(n, b0 + kSquaresBlock);
    float s = 0;
    for (int64_t i = b0 + threadIdx.x; i < b1; i += blockDim.x) {
        const float g = grad_value(x[i]);
        s += g * g;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One block of kClipThreads: each thread sums a fixed strided subset of the partials in double,
// then a fixed tree over the threads (deterministic): a model has hundreds of thousands of
// partials, too many for one thread.
constexpr int kClipThreads = 1024;
// Σ partials on thread 0 of a kClipThreads block (the others return garbage).
__device__ double sum_block(const float* partials, int64_t count) {
    __shared__ double part[kClipThreads];
    double s = 0;
    for (int64_t i = threadIdx.x; i < count; i += kClipThreads) s += partials[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = kClipThreads / 2; w > 0; w >>= 1) {
        if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    return part[0];
}

__global__ void sum_partials_kernel(const float* partials, int64_t count, float* out) {
    const double s = sum_block(partials, count);
    if (threadIdx.x == 0) *out = float(s);
}

__global__ void clip_scale_kernel(const float* partials, int64_t count, float max_norm, float* norm,
                                  float* scale, int32_t* skip) {
    const double s = sum_block(partials, count);
    if (threadIdx.x != 0) return;
    const double nrm = sqrt(s);
    const bool finite = isfinite(nrm);
    *norm = float(nrm);
    *skip = finite ? 0 : 1;
    *scale =
        !finite ? 0.f : (max_norm > 0 && nrm > max_norm ? float(max_norm / (nrm + 1e-6)) : 1.f);
}

__global__ void merge_skip_kernel(int32_t* skip, int64_t n) {
    if (threadIdx.x != 0) return;
    int32_t any = 0;
    for (int64_t i = 0; i < n; ++i) any |= skip[i];
    for (int64_t i = 0; i < n; ++i) skip[i] = any;
}

__global__ void veto_skip_kernel(int32_t* skip, int64_t n, const int32_t* flag) {
    if (threadIdx.x != 0 || *flag == 0) return;
    for (int64_t i = 0; i < n; ++i) skip[i] = 1;
}

template <typename G>
__global__ void adamw_kernel(float* param, const G* grad, float* m, float* v, int64_t n, float lr,
                             float beta1, float beta2, float eps, float wd, float bc1, float bc2,
                             const float* grad_scale, const int32_t* skip, bf* param_bf16,
                             const float* schedule) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n || (skip && *skip)) return;
    if (schedule) lr = schedule[0], bc1 = schedule[1], bc2 = schedule[2];
    const float g = grad_value(grad[i]) * (grad_scale ? *grad_scale : 1.f);
    const float mi = beta1 * m[i] + (1.f - beta1) * g;
    const float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi, v[i] = vi;
    float p = param[i] * (1.f - lr * wd);
    p -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    param[i] = p;
    if (param_bf16) st(param_bf16 + i, p);
}

}  // namespace

int64_t sum_squares_blocks(int64_t n) {
    return (n + kSquaresBlock - 1) / kSquaresBlock;
}

void sum_squares_partials(const ExecContext& ctx, const float* x, int64_t n, float* partials) {
    if (n == 0) return;
    sum_squares_kernel<<<sum_squares_blocks(n), kThreads, 0, stream_of(ctx)>>>(x, n, partials);
    ST_CUDA_LAUNCH_CHECK();
}

void sum_squares_partials(const ExecContext& ctx, const bf16* x, int64_t n, float* partials) {
    if (n == 0) return;
    sum_squares_kernel<<<sum_squares_blocks(n), kThreads, 0, stream_of(ctx)>>>(dev(x), n, partials);
    ST_CUDA_LAUNCH_CHECK();
}

void clip_scale(const ExecContext& ctx, const float* partials, int64_t count, float max_norm,
                float* norm, float* scale, int32_t* skip) {
    clip_scale_kernel<<<1, kClipThreads, 0, stream_of(ctx)>>>(partials, count, max_norm, norm,
                                                              scale, skip);
    ST_CUDA_LAUNCH_CHECK();
}

void sum_partials(const ExecContext& ctx, const float* partials, int64_t count, float* out) {
    sum_partials_kernel<<<1, kClipThreads, 0, stream_of(ctx)>>>(partials, count, out);
    ST_CUDA_LAUNCH_CHECK();
}

void merge_skip(const ExecContext& ctx, int32_t* skip, int64_t n) {
    merge_skip_kernel<<<1, 32, 0, stream_of(ctx)>>>(skip, n);
    ST_CUDA_LAUNCH_CHECK();
}

void veto_skip(const ExecContext& ctx, int32_t* skip, int64_t n, const int32_t* flag) {
    veto_skip_kernel<<<1, 32, 0, stream_of(ctx)>>>(skip, n, flag);
    ST_CUDA_LAUNCH_CHECK();
}

namespace {

template <typename G>
void adamw_launch(const ExecContext& ctx, const AdamwHyper& hp, float* param, const G* grad,
                  float* m, float* v, int64_t n, const float* grad_scale, const int32_t* skip,
                  bf16* param_bf16) {
    const float lr = hp.lr, beta1 = hp.beta1, beta2 = hp.beta2, eps = hp.eps,
                weight_decay = hp.weight_decay;
    const int64_t step = hp.step;
    const float* schedule = hp.schedule;
    if (n == 0) return;
    // Host lr and step are baked into the launch; a replayed graph passes `schedule` instead.
    const float bc1 = float(1.0 - std::pow(double(beta1), double(step)));
    const float bc2 = float(1.0 - std::pow(double(beta2), double(step)));
    adamw_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
        param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale, skip,
        param_bf16 ? dev(param_bf16) : nullptr, schedule);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace

void adamw_update(const ExecContext& ctx, const AdamwHyper& hp, float* param, const float* grad,
                  float* m, float* v, int64_t n, const float* grad_scale, const int32_t* skip,
                  bf16* param_bf16) {
    adamw_launch(ctx, hp, param, grad, m, v, n, grad_scale, skip, param_bf16);
}

void adamw_update(const ExecContext& ctx, const AdamwHyper& hp, float* param, const bf16* grad,
                  float* m, float* v, int64_t n, const float* grad_scale, const int32_t* skip,
                  bf16* param_bf16) {
    adamw_launch(ctx, hp, param, dev(grad), m, v, n, grad_scale, skip, param_bf16);
}

}  // namespace sparsetron::cuda
