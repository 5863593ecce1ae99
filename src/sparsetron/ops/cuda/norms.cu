// RMSNorm and LayerNorm: one block per row for the row statistics and dx; the weight gradients
// are column sums over rows, taken in fixed 64-row chunks and then in chunk order (deterministic).
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/ops.h"

namespace sparsetron::cuda {
namespace {

constexpr int kRowChunk = 64;
constexpr int kThreads = 256;

__global__ void rmsnorm_fwd_kernel(const bf* x, int64_t ldx, const bf* w, int64_t dim, float eps,
                                   bf* y, int64_t ldy, float* rstd) {
    const int64_t r = blockIdx.x;
    const bf* xr = x + r * ldx;
    float ss = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = ld(xr + i);
        ss += v * v;
    }
    const float rs = rsqrtf(block_sum(ss) / float(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
        st(y + r * ldy + i, ld(w + i) * ld(xr + i) * rs);
    if (threadIdx.x == 0) rstd[r] = rs;
}

__global__ void rmsnorm_bwd_kernel(const bf* dy, int64_t lddy, const bf* x, int64_t ldx,
                                   const bf* w, const float* rstd, int64_t dim, bf* dx,
                                   int64_t lddx, bool accumulate) {
    const int64_t r = blockIdx.x;
    const bf *dyr = dy + r * lddy, *xr = x + r * ldx;
    float s = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
        s += ld(w + i) * ld(dyr + i) * ld(xr + i);
    s = block_sum(s);
    const float rs = rstd[r], c = rs * rs * rs * s / float(dim);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = rs * ld(w + i) * ld(dyr + i) - ld(xr + i) * c;
        bf* o = dx + r * lddx + i;
        st(o, accumulate ? ld(o) + v : v);
    }
}

// ws[chunk, i] = Σ_{r in chunk} f(r, i) for the weight gradients.
__global__ void rmsnorm_dw_partial(const bf* dy, int64_t lddy, const bf* x, int64_t ldx,
                                   const float* rstd, int64_t rows, int64_t dim, float* ws) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= dim) return;
    const int64_t r0 = blockIdx.y * int64_t(kRowChunk), r1 = min(rows, r0 + kRowChunk);
    float s = 0;
    for (int64_t r = r0; r < r1; ++r) s += ld(dy + r * lddy + i) * ld(x + r * ldx + i) * rstd[r];
    ws[blockIdx.y * dim + i] = s;
}

__global__ void column_reduce_add(const float* ws, int64_t chunks, int64_t dim, float* out) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= dim) return;
    float s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += ws[c * dim + i];
    out[i] += s;
}

__global__ void layernorm_fwd_kernel(const bf* x, const bf* w, const bf* b, int64_t dim, float eps,
                                     bf* y, float* mean, float* rstd) {
    const int64_t r = blockIdx.x;
    const bf* xr = x + r * dim;
    float s = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) s += ld(xr + i);
    const float mu = block_sum(s) / float(dim);
    float ss = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float d = ld(xr + i) - mu;
        ss += d * d;
    }
    const float rs = rsqrtf(block_sum(ss) / float(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
        st(y + r * dim + i, ld(w + i) * (ld(xr + i) - mu) * rs + ld(b + i));
    if (threadIdx.x == 0) mean[r] = mu, rstd[r] = rs;
}

__global__ void layernorm_bwd_kernel(const bf* dy, const bf* x, const bf* w, const float* mean,
                                     const float* rstd, int64_t dim, bf* dx) {
    const int64_t r = blockIdx.x;
    const bf *dyr = dy + r * dim, *xr = x + r * dim;
    const float mu = mean[r], rs = rstd[r];
    float sg = 0, sgx = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float g = ld(dyr + i) * ld(w + i), xh = (ld(xr + i) - mu) * rs;
        sg += g, sgx += g * xh;
    }
    sg = block_sum(sg) / float(dim);
    sgx = block_sum(sgx) / float(dim);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float g = ld(dyr + i) * ld(w + i), xh = (ld(xr + i) - mu) * rs;
        st(dx + r * dim + i, rs * (g - sg - xh * sgx));
    }
}

__global__ void layernorm_dwdb_partial(const bf* dy, const bf* x, const float* mean,
                                       const float* rstd, int64_t rows, int64_t dim, float* ws_w,
                                       float* ws_b) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= dim) return;
    const int64_t r0 = blockIdx.y * int64_t(kRowChunk), r1 = min(rows, r0 + kRowChunk);
    float sw = 0, sb = 0;
    for (int64_t r = r0; r < r1; ++r) {
        float d = ld(dy + r * dim + i);
        sw += d * (ld(x + r * dim + i) - mean[r]) * rstd[r];
        sb += d;
    }
    ws_w[blockIdx.y * dim + i] = sw;
    ws_b[blockIdx.y * dim + i] = sb;
}

int64_t chunks_of(int64_t rows) {
    return (rows + kRowChunk - 1) / kRowChunk;
}

}  // namespace

int64_t rmsnorm_ws_floats(int64_t rows, int64_t dim) {
    return chunks_of(rows) * dim;
}

void rmsnorm_forward(const ExecContext& ctx, const bf16* x, int64_t ldx, const bf16* w,
                     int64_t rows, int64_t dim, float eps, bf16* y, int64_t ldy, float* rstd) {
    if (rows == 0) return;
    rmsnorm_fwd_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(dev(x), ldx, dev(w), dim, eps, dev(y),
                                                              ldy, rstd);
    ST_CUDA_LAUNCH_CHECK();
}

void rmsnorm_backward(const ExecContext& ctx, const bf16* dy, int64_t lddy, const bf16* x,
                      int64_t ldx, const bf16* w, const float* rstd, int64_t rows, int64_t dim,
                      bf16* dx, int64_t lddx, bool accumulate, float* dw, float* ws) {
    if (rows == 0) return;
    cudaStream_t s = stream_of(ctx);
    rmsnorm_bwd_kernel<<<rows, kThreads, 0, s>>>(dev(dy), lddy, dev(x), ldx, dev(w), rstd, dim,
                                                 dev(dx), lddx, accumulate);
    ST_CUDA_LAUNCH_CHECK();
    if (!dw) return;
    dim3 grid(blocks_for(dim, kThreads), static_cast<unsigned>(chunks_of(rows)));
    rmsnorm_dw_partial<<<grid, kThreads, 0, s>>>(dev(dy), lddy, dev(x), ldx, rstd, rows, dim, ws);
    column_reduce_add<<<blocks_for(dim, kThreads), kThreads, 0, s>>>(ws, chunks_of(rows), dim, dw);
    ST_CUDA_LAUNCH_CHECK();
}

void layernorm_forward(const ExecContext& ctx, const bf16* x, const bf16* w, const bf16* b,
                       int64_t rows, int64_t dim, float eps, bf16* y, float* mean, float* rstd) {
    if (rows == 0) return;
    layernorm_fwd_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(dev(x), dev(w), dev(b), dim, eps,
                                                                dev(y), mean, rstd);
    ST_CUDA_LAUNCH_CHECK();
}

void layernorm_backward(const ExecContext& ctx, const bf16* dy, const bf16* x, const bf16* w,
                        const float* mean, const float* rstd, int64_t rows, int64_t dim, bf16* dx,
                        float* dw, float* db, float* ws) {
    if (rows == 0) return;
    cudaStream_t s = stream_of(ctx);
    layernorm_bwd_kernel<<<rows, kThreads, 0, s>>>(dev(dy), dev(x), dev(w), mean, rstd, dim,
                                                   dev(dx));
    const int64_t chunks = chunks_of(rows);
    float *ws_w = ws, *ws_b = ws + chunks * dim;
    dim3 grid(blocks_for(dim, kThreads), static_cast<unsigned>(chunks));
    layernorm_dwdb_partial<<<grid, kThreads, 0, s>>>(dev(dy), dev(x), mean, rstd, rows, dim, ws_w,
                                                     ws_b);
    column_reduce_add<<<blocks_for(dim, kThreads), kThreads, 0, s>>>(ws_w, chunks, dim, dw);
    column_reduce_add<<<blocks_for(dim, kThreads), kThreads, 0, s>>>(ws_b, chunks, dim, db);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
