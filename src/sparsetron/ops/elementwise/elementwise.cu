// Element-wise ops (elementwise.h): embedding, RoPE, SwiGLU (with the FP8 copies of its outputs),
// adds and fills.
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/fp8_block.cuh"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void embedding_fwd_kernel(const int32_t* tokens, const bf* table, int64_t dim, bf* out) {
    const int64_t r = blockIdx.x;
    const int32_t id = tokens[r];
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
        out[r * dim + i] = id < 0 ? __float2bfloat16(0.f) : table[int64_t(id) * dim + i];
}

__global__ void embedding_bwd_kernel(const int32_t* tokens, const bf* dout, int64_t dim,
                                     float* dtable) {
    const int64_t r = blockIdx.x;
    if (tokens[r] < 0) return;
    float* dst = dtable + int64_t(tokens[r]) * dim;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
        atomicAdd(dst + i, ld(dout + r * dim + i));
}

// One block per token: the token's dim / 2 rotation angles (pow and sincos in double, as the CPU
// reference) once into shared memory, then every (head, pair) of the token reads them: a double
// sincos per element would be the kernel's cost.
__global__ void rope_kernel(bf* x, int64_t heads, int64_t dim, int64_t ld_t, int64_t ld_h,
                            const int32_t* positions, double theta, bool interleaved, double sign) {
    extern __shared__ double rot[];  // [half] cos, then [half] sin
    const int64_t half = dim / 2, t = blockIdx.x;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
        const double angle = double(positions[t]) * pow(theta, -2.0 * double(i) / double(dim));
        double s, c;
        sincos(angle, &s, &c);
        rot[i] = c;
        rot[half + i] = s * sign;
    }
    __syncthreads();
    for (int64_t id = threadIdx.x; id < heads * half; id += blockDim.x) {
        const int64_t i = id % half, h = id / half;
        const double c = rot[i], s = rot[half + i];
        const int64_t i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
        bf* p = x + t * ld_t + h * ld_h;
        const double a = ld(p + i0), b = ld(p + i1);
        st(p + i0, float(a * c - b * s));
        st(p + i1, float(a * s + b * c));
    }
}

__device__ __forceinline__ float sigmoidf(float x) {
    return 1.f / (1.f + __expf(-x));
}

__device__ __forceinline__ float swiglu_value(float g, float u) {
    return g * sigmoidf(g) * u;
}
__device__ __forceinline__ void swiglu_grads(float g, float u, float d, float& dg, float& du) {
    const float sg = sigmoidf(g);
    dg = d * u * sg * (1.f + g * (1.f - sg));
    du = d * g * sg;
}

// Eight bf16 per thread as one 16-byte access (the vector kernels; n % 8 == 0 and 16-byte aligned
// pointers, checked by the launchers), otherwise one element per thread.

__global__ void swiglu_fwd_kernel(const bf* g, const bf* u, int64_t n, bf* out) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    st(out + i, swiglu_value(ld(g + i), ld(u + i)));
}

__global__ void swiglu_fwd_vec_kernel(const uint4* g, const uint4* u, int64_t n8, uint4* out) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n8) return;
    Bf16x8 a, b, o;
    a.v = g[i];
    b.v = u[i];
    for (int j = 0; j < 4; ++j) {
        const float2 x = __bfloat1622float2(a.p[j]), y = __bfloat1622float2(b.p[j]);
        o.p[j] = __floats2bfloat162_rn(swiglu_value(x.x, y.x), swiglu_value(x.y, y.y));
    }
    out[i] = o.v;
}

__global__ void swiglu_bwd_kernel(const bf* g, const bf* u, const bf* dout, int64_t n, bf* dg,
                                  bf* du) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    float a, b;
    swiglu_grads(ld(g + i), ld(u + i), ld(dout + i), a, b);
    st(dg + i, a);
    st(du + i, b);
}

__global__ void swiglu_bwd_vec_kernel(const uint4* g, const uint4* u, const uint4* dout, int64_t n8,
                                      uint4* dg, uint4* du) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n8) return;
    Bf16x8 a, b, d, og, ou;
    a.v = g[i];
    b.v = u[i];
    d.v = dout[i];
    for (int j = 0; j < 4; ++j) {
        const float2 x = __bfloat1622float2(a.p[j]), y = __bfloat1622float2(b.p[j]),
                     z = __bfloat1622float2(d.p[j]);
        float g0, u0, g1, u1;
        swiglu_grads(x.x, y.x, z.x, g0, u0);
        swiglu_grads(x.y, y.y, z.y, g1, u1);
        og.p[j] = __floats2bfloat162_rn(g0, g1);
        ou.p[j] = __floats2bfloat162_rn(u0, u1);
    }
    dg[i] = og.v;
    du[i] = ou.v;
}

// The vector kernels over [rows, cols] (cols a multiple of 128) writing the FP8 copies of their
// outputs too, quantized from the bf16 values written. Chunk i is (row i / (cols / 8), chunk
// i % (cols / 8)); blocks of kThreads start at multiples of 16 chunks and n8 is one, so a
// half-warp (one 1x128 block) is all in or all out.
__global__ void swiglu_fwd_fp8_kernel(const uint4* g, const uint4* u, int64_t n8, int64_t cols,
                                      uint4* out, Fp8RowsOut out8) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n8) return;
    float a[8], b[8], o[8];
    unpack8(g[i], a);
    unpack8(u[i], b);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = swiglu_value(a[j], b[j]);
    const uint4 written = pack8(o);
    out[i] = written;
    unpack8(written, o);
    fp8_dev::store_row_chunk_fp8(o, out8.pow2, i / (cols / 8), i % (cols / 8), cols, out8.rows,
                                 out8.q, out8.scale_inv);
}

__global__ void swiglu_bwd_fp8_kernel(const uint4* g, const uint4* u, const uint4* dout, int64_t n8,
                                      int64_t cols, uint4* dg, uint4* du, Fp8RowsOut dg8,
                                      Fp8RowsOut du8) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n8) return;
    float a[8], b[8], d[8], og[8], ou[8];
    unpack8(g[i], a);
    unpack8(u[i], b);
    unpack8(dout[i], d);
#pragma unroll
    for (int j = 0; j < 8; ++j) swiglu_grads(a[j], b[j], d[j], og[j], ou[j]);
    const uint4 wg = pack8(og), wu = pack8(ou);
    dg[i] = wg;
    du[i] = wu;
    unpack8(wg, og);
    unpack8(wu, ou);
    const int64_t r = i / (cols / 8), chunk = i % (cols / 8);
    fp8_dev::store_row_chunk_fp8(og, dg8.pow2, r, chunk, cols, dg8.rows, dg8.q, dg8.scale_inv);
    fp8_dev::store_row_chunk_fp8(ou, du8.pow2, r, chunk, cols, du8.rows, du8.q, du8.scale_inv);
}

template <typename T>
__global__ void add_kernel(T* y, const T* x, int64_t n) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i < n) st(y + i, ld(y + i) + ld(x + i));
}

__global__ void fill_kernel(float* x, int64_t n, float v) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i < n) x[i] = v;
}

// n bf16 elements at each pointer can go as 16-byte vectors.
template <typename... P>
bool vectorizable(int64_t n, const P*... ptrs) {
    return n % 8 == 0 && aligned16(ptrs...);
}

}  // namespace

void embedding_forward(const ExecContext& ctx, const int32_t* tokens, int64_t rows,
                       const bf16* table, int64_t dim, bf16* out) {
    if (rows == 0) return;
    embedding_fwd_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(tokens, dev(table), dim, dev(out));
    ST_CUDA_LAUNCH_CHECK();
}

void embedding_backward(const ExecContext& ctx, const int32_t* tokens, int64_t rows,
                        const bf16* dout, int64_t dim, float* dtable) {
    if (rows == 0) return;
    embedding_bwd_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(tokens, dev(dout), dim, dtable);
    ST_CUDA_LAUNCH_CHECK();
}

void rope(const ExecContext& ctx, bf16* x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_t,
          int64_t ld_h, const int32_t* positions, double theta, bool interleaved, bool inverse) {
    if (tokens == 0 || heads == 0 || dim < 2) return;
    const size_t smem = size_t(dim / 2) * 2 * sizeof(double);
    ST_CHECK(smem <= 48 * 1024, "rope: ", dim, " dims exceed the kernel's shared-memory table");
    rope_kernel<<<unsigned(tokens), kThreads, smem, stream_of(ctx)>>>(
        dev(x), heads, dim, ld_t, ld_h, positions, theta, interleaved, inverse ? -1.0 : 1.0);
    ST_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(const ExecContext& ctx, const bf16* g, const bf16* u, int64_t n, bf16* out) {
    if (n == 0) return;
    if (vectorizable(n, g, u, out))
        swiglu_fwd_vec_kernel<<<blocks_for(n / 8, kThreads), kThreads, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(g), reinterpret_cast<const uint4*>(u), n / 8,
            reinterpret_cast<uint4*>(out));
    else
        swiglu_fwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(dev(g), dev(u),
                                                                                    n, dev(out));
    ST_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(const ExecContext& ctx, const bf16* g, const bf16* u, const bf16* dout,
                     int64_t n, bf16* dg, bf16* du) {
    if (n == 0) return;
    if (vectorizable(n, g, u, dout, dg, du))
        swiglu_bwd_vec_kernel<<<blocks_for(n / 8, kThreads), kThreads, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(g), reinterpret_cast<const uint4*>(u),
            reinterpret_cast<const uint4*>(dout), n / 8, reinterpret_cast<uint4*>(dg),
            reinterpret_cast<uint4*>(du));
    else
        swiglu_bwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
            dev(g), dev(u), dev(dout), n, dev(dg), dev(du));
    ST_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(const ExecContext& ctx, const bf16* g, const bf16* u, int64_t rows,
                    int64_t cols, bf16* out, const Fp8RowsOut& out8) {
    const int64_t n = rows * cols;
    if (n == 0) return;
    if (out8.q && cols % 128 == 0 && vectorizable(n, g, u, out) && aligned16(out8.q)) {
        swiglu_fwd_fp8_kernel<<<blocks_for(n / 8, kThreads), kThreads, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(g), reinterpret_cast<const uint4*>(u), n / 8, cols,
            reinterpret_cast<uint4*>(out), out8);
        ST_CUDA_LAUNCH_CHECK();
        return;
    }
    swiglu_forward(ctx, g, u, n, out);
    if (out8.q) quantize_fp8_1x128(ctx, out, rows, cols, cols, out8.pow2, out8.q, out8.scale_inv);
}

void swiglu_backward(const ExecContext& ctx, const bf16* g, const bf16* u, const bf16* dout,
                     int64_t rows, int64_t cols, bf16* dg, bf16* du, const Fp8RowsOut& dg8,
                     const Fp8RowsOut& du8) {
    const int64_t n = rows * cols;
    if (n == 0) return;
    if (dg8.q && du8.q && cols % 128 == 0 && vectorizable(n, g, u, dout, dg, du) &&
        aligned16(dg8.q, du8.q)) {
        swiglu_bwd_fp8_kernel<<<blocks_for(n / 8, kThreads), kThreads, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(g), reinterpret_cast<const uint4*>(u),
            reinterpret_cast<const uint4*>(dout), n / 8, cols, reinterpret_cast<uint4*>(dg),
            reinterpret_cast<uint4*>(du), dg8, du8);
        ST_CUDA_LAUNCH_CHECK();
        return;
    }
    swiglu_backward(ctx, g, u, dout, n, dg, du);
    for (const auto& [x, x8] : {std::pair{dg, &dg8}, std::pair{du, &du8}})
        if (x8->q) quantize_fp8_1x128(ctx, x, rows, cols, cols, x8->pow2, x8->q, x8->scale_inv);
}

void add_inplace(const ExecContext& ctx, bf16* y, const bf16* x, int64_t n) {
    if (n == 0) return;
    add_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(dev(y), dev(x), n);
    ST_CUDA_LAUNCH_CHECK();
}

void add_inplace(const ExecContext& ctx, float* y, const float* x, int64_t n) {
    if (n == 0) return;
    add_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(y, x, n);
    ST_CUDA_LAUNCH_CHECK();
}

void fill(const ExecContext& ctx, float* x, int64_t n, float value) {
    if (n == 0) return;
    fill_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(x, n, value);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
