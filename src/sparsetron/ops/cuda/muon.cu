// Muon's element-wise pieces on the device; the Newton-Schulz products go through cuda::gemm.
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

__global__ void gather_kernel(const float* g, const float* mom, int64_t cols, int64_t row0,
                              int64_t rows, float beta, bool nesterov, const float* scale, float* x,
                              int64_t x_row0) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= rows * cols) return;
    const int64_t k = row0 * cols + i;
    x[x_row0 * cols + i] =
        nesterov ? (1.f - beta) * g[k] * (scale ? *scale : 1.f) + beta * mom[k] : mom[k];
}

__global__ void apply_kernel(float* w, const float* x, int64_t cols, int64_t row0, int64_t rows,
                             int64_t x_row0, float step, const int32_t* skip, const float* lr) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= rows * cols || (skip && *skip)) return;
    w[row0 * cols + i] -= (lr ? *lr * step : step) * x[x_row0 * cols + i];
}

__global__ void transpose_kernel(const float* in, int64_t rows, int64_t cols, float* out) {
    __shared__ float tile[32][33];
    const int64_t c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
        const int64_t r = r0 + dy, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[dy][threadIdx.x] = in[r * cols + c];
    }
    __syncthreads();
    for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
        const int64_t c = c0 + dy, r = r0 + threadIdx.x;
        if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][dy];
    }
}

__global__ void scale_inv_kernel(float* x, int64_t n, const float* norm, float eps) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i < n) x[i] *= 1.f / (*norm + eps);
}

__global__ void axpby_kernel(const float* a1, const float* a2, float b, float c, int64_t n,
                             float* out) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i < n) out[i] = b * a1[i] + c * a2[i];
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

void muon_gather(const ExecContext& ctx, const float* g, const float* mom, int64_t cols,
                 int64_t row0, int64_t rows, float beta, bool nesterov, const float* scale,
                 float* x, int64_t x_row0) {
    const int64_t n = rows * cols;
    if (n == 0) return;
    gather_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
        g, mom, cols, row0, rows, beta, nesterov, scale, x, x_row0);
    ST_CUDA_LAUNCH_CHECK();
}

void muon_apply(const ExecContext& ctx, float* w, const float* x, int64_t cols, int64_t row0,
                int64_t rows, int64_t x_row0, float step, const int32_t* skip, const float* lr) {
    const int64_t n = rows * cols;
    if (n == 0) return;
    apply_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(w, x, cols, row0, rows,
                                                                           x_row0, step, skip, lr);
    ST_CUDA_LAUNCH_CHECK();
}

void transpose(const ExecContext& ctx, const float* in, int64_t rows, int64_t cols, float* out) {
    if (rows == 0 || cols == 0) return;
    dim3 grid(blocks_for(cols, 32), blocks_for(rows, 32));
    transpose_kernel<<<grid, dim3(32, 8), 0, stream_of(ctx)>>>(in, rows, cols, out);
    ST_CUDA_LAUNCH_CHECK();
}

void scale_by_inverse_norm(const ExecContext& ctx, float* x, int64_t n, const float* norm,
                           float eps) {
    if (n == 0) return;
    scale_inv_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(x, n, norm, eps);
    ST_CUDA_LAUNCH_CHECK();
}

void axpby(const ExecContext& ctx, const float* a1, const float* a2, float b, float c, int64_t n,
           float* out) {
    if (n == 0) return;
    axpby_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(a1, a2, b, c, n, out);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
