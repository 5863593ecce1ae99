// RMSNorm and LayerNorm: one block per row for the row statistics and dx; the weight gradients
// are column sums over rows, taken in fixed 64-row chunks and then in chunk order (deterministic).
#include <initializer_list>
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/norm/norm.h"

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

// The vector forms: rows whose dim, strides and pointers allow 16-byte accesses of 8 bf16, at most
// kVecPerThread vectors per thread. Each thread keeps its vectors of x (and dy) in registers
// across the block reduction, so a row is read once instead of twice, and every access is 16 bytes
// instead of 2 (the scalar kernels above stay well below the memory bandwidth).
constexpr int kVecPerThread = 4;
__global__ void rmsnorm_fwd_vec_kernel(const uint4* x, int64_t ldx8, const uint4* w, int64_t dim8,
                                       float eps, uint4* y, int64_t ldy8, float* rstd) {
    const int64_t r = blockIdx.x;
    uint4 xv[kVecPerThread];
    float ss = 0;
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k) {
        const int64_t i = threadIdx.x + int64_t(k) * blockDim.x;
        if (i >= dim8) break;
        xv[k] = x[r * ldx8 + i];
        float f[8];
        unpack8(xv[k], f);
        for (int j = 0; j < 8; ++j) ss += f[j] * f[j];
    }
    const float rs = rsqrtf(block_sum(ss) / float(dim8 * 8) + eps);
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k) {
        const int64_t i = threadIdx.x + int64_t(k) * blockDim.x;
        if (i >= dim8) break;
        float f[8], g[8];
        unpack8(xv[k], f);
        unpack8(w[i], g);
        for (int j = 0; j < 8; ++j) f[j] = g[j] * f[j] * rs;
        y[r * ldy8 + i] = pack8(f);
    }
    if (threadIdx.x == 0) rstd[r] = rs;
}

__global__ void rmsnorm_bwd_vec_kernel(const uint4* dy, int64_t lddy8, const uint4* x, int64_t ldx8,
                                       const uint4* w, const float* rstd, int64_t dim8, uint4* dx,
                                       int64_t lddx8, bool accumulate) {
    const int64_t r = blockIdx.x;
    uint4 xv[kVecPerThread], gv[kVecPerThread];  // x and w * dy (as bf16 pairs of floats below)
    float s = 0;
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k) {
        const int64_t i = threadIdx.x + int64_t(k) * blockDim.x;
        if (i >= dim8) break;
        xv[k] = x[r * ldx8 + i];
        gv[k] = dy[r * lddy8 + i];
        float fx[8], fd[8], fw[8];
        unpack8(xv[k], fx);
        unpack8(gv[k], fd);
        unpack8(w[i], fw);
        for (int j = 0; j < 8; ++j) s += fw[j] * fd[j] * fx[j];
    }
    s = block_sum(s);
    const float rs = rstd[r], c = rs * rs * rs * s / float(dim8 * 8);
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k) {
        const int64_t i = threadIdx.x + int64_t(k) * blockDim.x;
        if (i >= dim8) break;
        float fx[8], fd[8], fw[8], o[8];
        unpack8(xv[k], fx);
        unpack8(gv[k], fd);
        unpack8(w[i], fw);
        if (accumulate) unpack8(dx[r * lddx8 + i], o);
        for (int j = 0; j < 8; ++j) {
            const float v = rs * fw[j] * fd[j] - fx[j] * c;
            o[j] = accumulate ? o[j] + v : v;
        }
        dx[r * lddx8 + i] = pack8(o);
    }
}

// Whether a row of `dim` with these strides and pointers takes the vector kernels.
bool rows_vectorizable(int64_t dim, std::initializer_list<int64_t> strides,
                       std::initializer_list<const void*> ptrs) {
    if (dim % 8 != 0 || dim / 8 > int64_t(kVecPerThread) * kThreads) return false;
    for (int64_t s : strides)
        if (s % 8 != 0) return false;
    for (const void* p : ptrs)
        if (!aligned16(p)) return false;
    return true;
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
    if (rows_vectorizable(dim, {ldx, ldy}, {x, w, y}))
        rmsnorm_fwd_vec_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(x), ldx / 8, reinterpret_cast<const uint4*>(w), dim / 8,
            eps, reinterpret_cast<uint4*>(y), ldy / 8, rstd);
    else
        rmsnorm_fwd_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(dev(x), ldx, dev(w), dim, eps,
                                                                  dev(y), ldy, rstd);
    ST_CUDA_LAUNCH_CHECK();
}

void rmsnorm_backward(const ExecContext& ctx, const bf16* dy, int64_t lddy, const bf16* x,
                      int64_t ldx, const bf16* w, const float* rstd, int64_t rows, int64_t dim,
                      bf16* dx, int64_t lddx, bool accumulate, float* dw, float* ws) {
    if (rows == 0) return;
    cudaStream_t s = stream_of(ctx);
    if (rows_vectorizable(dim, {lddy, ldx, lddx}, {dy, x, w, dx}))
        rmsnorm_bwd_vec_kernel<<<rows, kThreads, 0, s>>>(
            reinterpret_cast<const uint4*>(dy), lddy / 8, reinterpret_cast<const uint4*>(x),
            ldx / 8, reinterpret_cast<const uint4*>(w), rstd, dim / 8, reinterpret_cast<uint4*>(dx),
            lddx / 8, accumulate);
    else
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
