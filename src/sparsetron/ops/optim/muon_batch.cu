// Batched Muon pieces (muon_batch.h). The gather and apply kernels move 32 x 32 tiles through
// shared memory so both the parameter rows and the (possibly transposed) stack are read and
// written along their contiguous dimension; blockIdx.z is the problem.
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/optim/muon_batch.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace sparsetron::cuda {
namespace {

constexpr int kTile = 32, kTileRows = 8;
constexpr int kThreads = 256;

// Nearly every problem is one segment (a whole matrix or one head's rows): its rows map without
// the 64-bit division and remainder, which cost ~150 instructions per element and made the gather
// and apply kernels instruction-bound (docs/perf/log/).
__device__ __forceinline__ int64_t param_row(const MuonDeviceProblem& p, int64_t r) {
    if (r < p.seg_rows) return p.row0 + r;
    return p.row0 + (r / p.seg_rows) * p.seg_stride + r % p.seg_rows;
}

constexpr int kPerThread = kTile / kTileRows;  // rows of a tile per thread

// The tile kernels load every value a thread needs before storing any: the stores may alias the
// loads as far as the compiler knows, so a load / store loop runs one memory round trip per row.

// With `skips` (the momentum update fused in: each element belongs to one problem), the momentum
// is updated here first, M = beta M + (1 - beta) G scale, unless skips[group]. With `partials`,
// each block also writes the sum of squares of its tile's values (one float per tile, tiles of a
// matrix in grid order): the normalization's partial sums without reading x back.
template <bool Tr>
__global__ void gather_kernel(const MuonDeviceProblem* problems, int64_t rows, int64_t cols,
                              float beta, bool nesterov, const float* scales, float* x,
                              const int32_t* skips, float* partials) {
    __shared__ float tile[kTile][kTile + 1];
    __shared__ float warp_squares[kTileRows];
    const MuonDeviceProblem p = problems[blockIdx.z];
    const float scale = scales ? scales[p.group] : 1.f;
    const bool update = skips && !skips[p.group], read_grad = nesterov || update;
    float* out = x + int64_t(blockIdx.z) * rows * cols;
    const int64_t c0 = int64_t(blockIdx.x) * kTile, r0 = int64_t(blockIdx.y) * kTile;
    const int64_t c = c0 + threadIdx.x;
    int64_t at[kPerThread];
    float m[kPerThread], g[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        const int64_t r = r0 + threadIdx.y + i * kTileRows;
        at[i] = r < rows && c < cols ? param_row(p, r) * cols + c : -1;
        m[i] = at[i] >= 0 ? p.mom[at[i]] : 0.f;
        g[i] = at[i] < 0 || !read_grad ? 0.f
               : p.grad16 ? __bfloat162float(reinterpret_cast<const bf*>(p.grad16)[at[i]])
                          : p.grad[at[i]];
    }
    float squares = 0.f;  // outside the matrix m = g = 0: u = 0
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        const int dy = threadIdx.y + i * kTileRows;
        const float gs = (1.f - beta) * g[i] * scale;
        if (update) {
            m[i] = beta * m[i] + gs;
            if (at[i] >= 0) p.mom[at[i]] = m[i];
        }
        const float u = nesterov ? gs + beta * m[i] : m[i];
        squares += u * u;
        if (Tr)
            tile[dy][threadIdx.x] = u;
        else if (at[i] >= 0)
            out[(r0 + dy) * cols + c] = u;
    }
    if (partials) {
        // A warp is one threadIdx.y (blockDim.x = 32); the eight warps' sums in a fixed order.
        squares = warp_sum(squares);
        if (threadIdx.x == 0) warp_squares[threadIdx.y] = squares;
        __syncthreads();
        if (threadIdx.x == 0 && threadIdx.y == 0) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < kTileRows; ++w) s += warp_squares[w];
            const int64_t tiles = int64_t(gridDim.x) * gridDim.y;
            partials[int64_t(blockIdx.z) * tiles + int64_t(blockIdx.y) * gridDim.x + blockIdx.x] =
                s;
        }
    }
    if (!Tr) return;
    __syncthreads();
    for (int dy = threadIdx.y; dy < kTile; dy += kTileRows) {
        const int64_t cc = c0 + dy, r = r0 + threadIdx.x;
        if (r < rows && cc < cols) out[cc * rows + r] = tile[threadIdx.x][dy];
    }
}

template <bool Tr, typename E>
__global__ void apply_kernel(const MuonDeviceProblem* problems, int64_t rows, int64_t cols,
                             const E* w, float step, const int32_t* skips, const float* lr,
                             float weight_decay) {
    __shared__ float tile[kTile][kTile + 1];
    const MuonDeviceProblem p = problems[blockIdx.z];
    if (skips && skips[p.group]) return;
    const float rate = lr ? *lr : 1.f, s = rate * step,
                decay = p.decays ? 1.f - rate * weight_decay : 1.f;
    const E* o = w + int64_t(blockIdx.z) * rows * cols;
    const int64_t c0 = int64_t(blockIdx.x) * kTile, r0 = int64_t(blockIdx.y) * kTile;
    if (Tr) {
        // o is [cols, rows]: read along r, write the parameter along c.
        for (int dy = threadIdx.y; dy < kTile; dy += kTileRows) {
            const int64_t c = c0 + dy, r = r0 + threadIdx.x;
            if (r < rows && c < cols) tile[dy][threadIdx.x] = ld(o + c * rows + r);
        }
        __syncthreads();
    }
    const int64_t c = c0 + threadIdx.x;
    int64_t at[kPerThread];
    float v[kPerThread], m[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        const int dy = threadIdx.y + i * kTileRows;
        const int64_t r = r0 + dy;
        at[i] = r < rows && c < cols ? param_row(p, r) * cols + c : -1;
        v[i] = at[i] < 0 ? 0.f : Tr ? tile[threadIdx.x][dy] : ld(o + r * cols + c);
        m[i] = at[i] >= 0 ? p.master[at[i]] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        if (at[i] < 0) continue;
        const float nm = m[i] * decay - s * v[i];
        p.master[at[i]] = nm;
        if (p.weights) reinterpret_cast<bf*>(p.weights)[at[i]] = __float2bfloat16(nm);
    }
}

// One block per matrix: strided double sums, then a fixed-order tree (deterministic). One thread
// per matrix would sum thousands of partials serially (a big matrix alone in its batch).
__global__ void inverse_norms_kernel(const float* partials, int64_t blocks, float eps, float scale,
                                     float* inv) {
    __shared__ double part[kThreads];
    const float* mine = partials + int64_t(blockIdx.x) * blocks;
    double s = 0;
    for (int64_t b = threadIdx.x; b < blocks; b += kThreads) s += mine[b];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
        if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) inv[blockIdx.x] = float(double(scale) / (sqrt(part[0]) + double(eps)));
}

// w[p] = x[p] inv[p] for `count` matrices of n elements, 4 per thread with `vec` (n % 4 == 0,
// aligned rows: 16-byte loads). blockIdx.y strides over the matrices, so finding an element's
// matrix costs no 64-bit division per element.
template <typename E>
__global__ void scale_kernel(const float* x, int64_t n, int64_t count, const float* inv, E* w,
                             bool vec) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x,
                  first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    for (int64_t p = blockIdx.y; p < count; p += gridDim.y) {
        const float s = inv[p];
        const float* xp = x + p * n;
        E* wp = w + p * n;
        if (vec) {
            for (int64_t i = first; i < n / 4; i += stride) {
                const float4 v = reinterpret_cast<const float4*>(xp)[i];
                st(wp + 4 * i, v.x * s), st(wp + 4 * i + 1, v.y * s);
                st(wp + 4 * i + 2, v.z * s), st(wp + 4 * i + 3, v.w * s);
            }
        } else {
            for (int64_t i = first; i < n; i += stride) st(wp + i, xp[i] * s);
        }
    }
}

// out[i][m + j] = out[m + i][j] for i, j < m (ld = 2m): the upper-right block of a symmetric
// product from the lower-left one. blockIdx.z is the matrix.
template <typename E>
__global__ void mirror_kernel(E* out, int64_t m, int64_t stride) {
    __shared__ E tile[kTile][kTile + 1];
    E* o = out + int64_t(blockIdx.z) * stride;
    const int64_t ld = 2 * m, c0 = int64_t(blockIdx.x) * kTile, r0 = int64_t(blockIdx.y) * kTile;
    for (int dy = threadIdx.y; dy < kTile; dy += kTileRows) {
        const int64_t r = r0 + dy, c = c0 + threadIdx.x;  // in the lower-left block
        if (r < m && c < m) tile[dy][threadIdx.x] = o[(m + r) * ld + c];
    }
    __syncthreads();
    for (int dy = threadIdx.y; dy < kTile; dy += kTileRows) {
        const int64_t r = c0 + dy, c = r0 + threadIdx.x;  // in the upper-right block
        if (r < m && c < m) o[r * ld + m + c] = tile[threadIdx.x][dy];
    }
}

// The same for 16-bit elements when m % 8 == 0, in 64 x 64 tiles moved as 16-byte vectors: the
// scalar kernel's 2-byte accesses move 64 bytes per warp request. A warp writes 4 rows x 128
// bytes (whole sectors). The tile's rows
// are 33 words apart: the transposed reads (8 rows 8 apart per warp request) meet 2-way conflicts.
constexpr int kVecTile = 64, kVecLd = kVecTile + 2, kVecThreads = 256;
__global__ void __launch_bounds__(kVecThreads)
    mirror16_kernel(uint16_t* out, int64_t m, int64_t stride) {
    __shared__ uint32_t tile[kVecTile * kVecLd / 2];
    uint16_t* o = out + int64_t(blockIdx.z) * stride;
    const int64_t ld = 2 * m, c0 = int64_t(blockIdx.x) * kVecTile,
                  r0 = int64_t(blockIdx.y) * kVecTile;
    // Load the lower-left tile rows r0.., columns c0..: 64 rows x 8 vectors.
    for (int v = threadIdx.x; v < kVecTile * 8; v += kVecThreads) {
        const int i = v >> 3, j8 = (v & 7) * 8;
        const int64_t r = r0 + i, c = c0 + j8;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r < m && c < m) x = *reinterpret_cast<const uint4*>(o + (m + r) * ld + c);
        uint32_t* t = tile + (i * kVecLd + j8) / 2;
        t[0] = x.x, t[1] = x.y, t[2] = x.z, t[3] = x.w;
    }
    __syncthreads();
    // Write row c0 + j of the upper-right block, columns r0 + 8 g .. + 7: tile[8 g ..][j].
    const uint16_t* th = reinterpret_cast<const uint16_t*>(tile);
    for (int v = threadIdx.x; v < kVecTile * 8; v += kVecThreads) {
        const int g = v & 7, j = v >> 3;
        const int64_t r = c0 + j, c = r0 + 8 * g;
        if (r >= m || c >= m) continue;
        uint16_t e[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) e[k] = th[(8 * g + k) * kVecLd + j];
        uint4 x;
        x.x = e[0] | uint32_t(e[1]) << 16, x.y = e[2] | uint32_t(e[3]) << 16;
        x.z = e[4] | uint32_t(e[5]) << 16, x.w = e[6] | uint32_t(e[7]) << 16;
        *reinterpret_cast<uint4*>(o + r * ld + m + c) = x;
    }
}

// The smallest Gram size computed as three half-size blocks (smaller ones are latency-bound:
// one GEMM is faster there).
constexpr int64_t kSymmetricMin = 512;

// out = alpha X op(Z) + beta c_in, op(Z) = Z^T when `transpose_z` (X, Z [rr, k], k = rr
// otherwise; stride xs; Z may be X) and out, c_in [rr, rr] (stride os; c_in may be out), where the
// product is known to be symmetric: X X^T, and in the Gram form products of symmetric matrices
// that commute. For an even rr >= kSymmetricMin the two diagonal blocks and the lower-left block
// are three GEMMs of half the rows (3/4 of the FLOPs), the upper-right block a transposed copy.
// The Gram form's [rr, rr] products take Z as it is, not transposed: their operands are symmetric
// only up to rounding, and with Z^T the antisymmetric rounding parts enter with the wrong sign and
// grow through the R updates (fp32 error vs fp64 5e-5 that way, 2e-6 without; CPU mock).
void symmetric_product(const ExecContext& ctx, const void* x, const void* z, bool transpose_z,
                       int64_t rr, int64_t k, float alpha, float beta, const void* c_in, void* out,
                       DType elem, int64_t count, int64_t xs, int64_t os, bool tf32) {
    ST_ASSERT(transpose_z || k == rr, "symmetric_product: X Z needs square operands");
    const GemmBatch g{count, xs, xs, os, tf32};
    if (rr < kSymmetricMin || rr % 2 != 0) {
        gemm_out(ctx, false, transpose_z, rr, rr, k, alpha, x, k, z, transpose_z ? k : rr, beta,
                 c_in, out, rr, elem, elem, g);
        return;
    }
    const int64_t m = rr / 2, es = int64_t(dtype_size(elem));
    const char* x1 = static_cast<const char*>(x);
    const char* x2 = x1 + m * k * es;
    // Z's first and second m rows (Z^T's columns) or its first and second m columns.
    const char* z1 = static_cast<const char*>(z);
    const char* z2 = z1 + (transpose_z ? m * k : m) * es;
    const int64_t ldz = transpose_z ? k : rr;
    const char* ci = static_cast<const char*>(c_in);
    char* o = static_cast<char*>(out);
    gemm_out(ctx, false, transpose_z, m, m, k, alpha, x1, k, z1, ldz, beta, ci, o, rr, elem, elem,
             g);
    gemm_out(ctx, false, transpose_z, m, m, k, alpha, x2, k, z1, ldz, beta, ci + m * rr * es,
             o + m * rr * es, rr, elem, elem, g);
    gemm_out(ctx, false, transpose_z, m, m, k, alpha, x2, k, z2, ldz, beta, ci + (m * rr + m) * es,
             o + (m * rr + m) * es, rr, elem, elem, g);
    ST_CHECK(count <= 65535, "symmetric_product: ", count, " matrices in one launch");
    const dim3 grid(blocks_for(m, kTile), blocks_for(m, kTile), unsigned(count)),
        block(kTile, kTileRows);
    if (es == 2 && m % 8 == 0 && os % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0)
        mirror16_kernel<<<dim3(blocks_for(m, kVecTile), blocks_for(m, kVecTile), unsigned(count)),
                          kVecThreads, 0, stream_of(ctx)>>>(static_cast<uint16_t*>(out), m, os);
    else if (es == 2)
        mirror_kernel<<<grid, block, 0, stream_of(ctx)>>>(static_cast<uint16_t*>(out), m, os);
    else
        mirror_kernel<<<grid, block, 0, stream_of(ctx)>>>(static_cast<float*>(out), m, os);
    ST_CUDA_LAUNCH_CHECK();
}

// out[p] = scale in[p] + a I for `count` [rr, rr] matrices (the Gram form's first polynomial,
// Q = a I + Z from t Z). blockIdx.y strides over the matrices, so the diagonal test is a 32-bit
// remainder within one matrix (a 64-bit division and remainder per element would bound it).
template <typename E>
__global__ void add_identity_kernel(const E* in, float scale, float a, uint32_t rr, uint32_t n2,
                                    int64_t count, E* out) {
    for (int64_t p = blockIdx.y; p < count; p += gridDim.y)
        for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n2;
             e += gridDim.x * blockDim.x) {
            const int64_t i = p * int64_t(n2) + e;
            st(out + i, scale * ld(in + i) + (e % (rr + 1) == 0 ? a : 0.f));
        }
}

void add_identity(const ExecContext& ctx, const void* in, float scale, float a, int64_t count,
                  int64_t rr, DType elem, void* out) {
    const int64_t n2 = rr * rr;
    ST_CHECK(n2 < (int64_t(1) << 32) / 2, "add_identity: [", rr, ", ", rr, "] is too large");
    const dim3 grid(unsigned(std::min<int64_t>(blocks_for(n2, kThreads), 1024)),
                    unsigned(std::min<int64_t>(count, 65535)));
    const auto r = uint32_t(rr), n = uint32_t(n2);
    if (elem == DType::F16)
        add_identity_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
            static_cast<const __half*>(in), scale, a, r, n, count, static_cast<__half*>(out));
    else if (elem == DType::BF16)
        add_identity_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
            static_cast<const bf*>(in), scale, a, r, n, count, static_cast<bf*>(out));
    else
        add_identity_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
            static_cast<const float*>(in), scale, a, r, n, count, static_cast<float*>(out));
    ST_CUDA_LAUNCH_CHECK();
}

dim3 tile_grid(int64_t rows, int64_t cols, int64_t count) {
    ST_CHECK(count <= 65535 && blocks_for(rows, kTile) <= 65535,
             "Muon batch too large for one launch: ", count, " matrices of ", rows, " rows");
    return dim3(blocks_for(cols, kTile), blocks_for(rows, kTile), unsigned(count));
}

// The gather's 32 x 32 tiles per matrix: one sum of squares each when it writes them.
int64_t gather_tiles(int64_t rows, int64_t cols) {
    return int64_t(blocks_for(rows, kTile)) * blocks_for(cols, kTile);
}

}  // namespace

void muon_gather_batch(const ExecContext& ctx, const MuonDeviceProblem* problems, int64_t count,
                       int64_t rows, int64_t cols, bool transpose, float beta, bool nesterov,
                       const float* scales, float* x, const int32_t* update_skips, float* norm_ws) {
    if (count == 0 || rows == 0 || cols == 0) return;
    const dim3 grid = tile_grid(rows, cols, count), block(kTile, kTileRows);
    if (transpose)
        gather_kernel<true><<<grid, block, 0, stream_of(ctx)>>>(
            problems, rows, cols, beta, nesterov, scales, x, update_skips, norm_ws);
    else
        gather_kernel<false><<<grid, block, 0, stream_of(ctx)>>>(
            problems, rows, cols, beta, nesterov, scales, x, update_skips, norm_ws);
    ST_CUDA_LAUNCH_CHECK();
}

int64_t muon_gathered_norm_floats(int64_t count, int64_t rows, int64_t cols) {
    return count * gather_tiles(rows, cols) + count;
}

namespace {
// ws: `blocks` partial sums of squares per matrix, then the inverse norms; w = scale x inv.
void scale_by_inverse_norms(const ExecContext& ctx, const float* x, int64_t count, int64_t n,
                            int64_t blocks, float eps, float* ws, DType w_type, void* w,
                            float scale) {
    float* inv = ws + count * blocks;
    inverse_norms_kernel<<<unsigned(count), kThreads, 0, stream_of(ctx)>>>(ws, blocks, eps, scale,
                                                                           inv);
    ST_CUDA_LAUNCH_CHECK();
    const dim3 grid(unsigned(std::min<int64_t>(blocks_for((n + 3) / 4, kThreads), 2048)),
                    unsigned(count));
    const bool vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(w) % (4 * dtype_size(w_type)) == 0;
    if (w_type == DType::BF16)
        scale_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(x, n, count, inv, static_cast<bf*>(w),
                                                            vec);
    else if (w_type == DType::F16)
        scale_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(x, n, count, inv,
                                                            static_cast<__half*>(w), vec);
    else
        scale_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(x, n, count, inv,
                                                            static_cast<float*>(w), vec);
    ST_CUDA_LAUNCH_CHECK();
}
}  // namespace

void muon_normalize_gathered(const ExecContext& ctx, const float* x, int64_t count, int64_t rows,
                             int64_t cols, float eps, float* ws, DType w_type, void* w,
                             float scale) {
    if (count == 0 || rows == 0 || cols == 0) return;
    ST_CHECK(count <= 65535, "Muon batch of ", count, " matrices is too large for one launch");
    scale_by_inverse_norms(ctx, x, count, rows * cols, gather_tiles(rows, cols), eps, ws, w_type, w,
                           scale);
}

void newton_schulz_batch(const ExecContext& ctx, void* w, void* y, void* a, void* b, int64_t count,
                         int64_t rr, int64_t cc,
                         const std::vector<std::array<float, 3>>& coefficients, DType elem,
                         bool tf32) {
    ST_CHECK(rr <= cc, "newton_schulz_batch wants the wide orientation, got ", rr, " x ", cc);
    ST_CHECK(elem == DType::F32 || elem == DType::BF16 || elem == DType::F16,
             "newton_schulz_batch: F32, BF16 or F16 elements, got ", dtype_name(elem));
    const int64_t es = dtype_size(elem), n = rr * cc, n2 = rr * rr;
    GemmBatch bx{count, n2, n, n, tf32};
    // The iterate alternates between w and y (each GEMM reads one and writes the other, its C
    // term read from the input: out of place, no copies); an odd count ends in y and is copied
    // back once.
    void* cur = w;
    void* next = y;
    for (const auto& [ca, cb, cc_] : coefficients) {
        // A = X X^T and A A = A A^T are symmetric.
        symmetric_product(ctx, cur, cur, true, rr, cc, 1.f, 0.f, a, a, elem, count, n, n2, tf32);
        // B = c A A + b A
        symmetric_product(ctx, a, a, true, rr, rr, cc_, cb, a, b, elem, count, n2, n2, tf32);
        // X' = B X + a X
        gemm_out(ctx, false, false, rr, cc, rr, 1.f, b, rr, cur, cc, ca, cur, next, cc, elem, elem,
                 bx);
        std::swap(cur, next);
    }
    if (cur != w) copy_2d(ctx, w, count * n * es, cur, count * n * es, count * n * es, 1);
}

float gram_ns_x_scale(int64_t rr, int64_t cc) {
    // ~sqrt(rr cc): the normalized entries' rms near 1. Every |entry| of a unit-norm X is <= 1, so
    // the cap keeps s X (and Q s X, whose singular values stay below ~1.2 s) under fp16's 65504.
    const int e = int(std::lround(0.5 * std::log2(double(rr) * double(cc))));
    return std::ldexp(1.f, std::clamp(e, 0, 14));
}

void newton_schulz_gram_batch(const ExecContext& ctx, void* w, void* y, void* squares,
                              int64_t count, int64_t rr, int64_t cc,
                              const std::vector<std::array<float, 3>>& coefficients,
                              const std::vector<int64_t>& restarts, DType elem, bool tf32,
                              float x_scale) {
    ST_CHECK(rr <= cc, "newton_schulz_gram_batch wants the wide orientation, got ", rr, " x ", cc);
    ST_CHECK(elem == DType::F32 || elem == DType::BF16 || elem == DType::F16,
             "newton_schulz_gram_batch: F32, BF16 or F16 elements, got ", dtype_name(elem));
    ST_CHECK(!coefficients.empty(), "newton_schulz_gram_batch: no iterations");
    const int64_t es = dtype_size(elem), n = rr * cc, n2 = rr * rr, steps = coefficients.size();
    // The [rr, rr] matrices R and Z are stored times t ~ rr (a power of two: exact): R's
    // eigenvalues average 1 / rr (trace 1), so unscaled the entries of a large R sit in fp16's
    // subnormals, whose absolute quantum 6e-8 would perturb its typical eigenvalues (~1.6e-4 at
    // rr = 6144) by ~2%. Scaled, |t Z| <= 4.1 t stays below 65504 (t <= 4096). Q (eigenvalues
    // below 4.1^3 ~ 69: at most three Q_i between restarts) is stored as is; x_scale (s) likewise
    // keeps X's entries normal. Every scale is folded into a GEMM's fp32 alpha and beta.
    const float t = std::ldexp(1.f, std::min(12, int(std::floor(std::log2(double(rr))))));
    const float s = x_scale;
    char* sq = static_cast<char*>(squares);
    void* R = sq;                         // t R
    void* Z = sq + count * n2 * es;       // t Z
    void* RZ = sq + 2 * count * n2 * es;  // t R Q_i
    void* Q = sq + 3 * count * n2 * es;
    void* Q_next = sq + 4 * count * n2 * es;
    auto restart_at = [&](int64_t i) { return gram_ns_restarts_at(restarts, i); };
    // The wide iterate (s X) alternates between w and y; the final Q X (alpha 1 / s) lands in w,
    // through y and one copy when the number of Q X products is odd.
    void* cur = w;
    void* next = y;
    auto apply_q = [&](float alpha) {  // X <- Q X
        gemm_out(ctx, false, false, rr, cc, rr, alpha, Q, rr, cur, cc, 0.f, next, next, cc, elem,
                 elem, GemmBatch{count, n2, n, n, tf32});
        std::swap(cur, next);
    };
    auto gram = [&] {  // t R = (t / s^2) (s X) (s X)^T
        symmetric_product(ctx, cur, cur, true, rr, cc, t / (s * s), 0.f, R, R, elem, count, n, n2,
                          tf32);
    };
    auto square_product = [&](const void* a, const void* b, float alpha, float beta,
                              const void* c_in, void* out) {  // out = alpha a b + beta c_in
        symmetric_product(ctx, a, b, false, rr, rr, alpha, beta, c_in, out, elem, count, n2, n2,
                          tf32);
    };
    gram();
    for (int64_t i = 0; i < steps; ++i) {
        const auto [ca, cb, cc_] = coefficients[size_t(i)];
        if (restart_at(i)) {
            apply_q(1.f);
            gram();
        }
        // t Z = (c / t) (t R)(t R) + b (t R): this iteration's polynomial is Q_i = a I + Z.
        square_product(R, R, cc_ / t, cb, R, Z);
        if (i == 0 || restart_at(i)) {
            add_identity(ctx, Z, 1.f / t, ca, count, rr, elem, Q);  // Q = a I + Z
        } else {
            square_product(Q, Z, 1.f / t, ca, Q, Q_next);  // Q Q_i = Q Z + a Q
            std::swap(Q, Q_next);
        }
        if (i + 1 < steps && !restart_at(i + 1)) {
            square_product(R, Z, 1.f / t, ca, R, RZ);   // t R Q_i = (t R) Z + a t R
            square_product(Z, RZ, 1.f / t, ca, RZ, R);  // t Q_i R Q_i
        }
    }
    apply_q(1.f / s);
    if (cur != w) copy_2d(ctx, w, count * n * es, cur, count * n * es, count * n * es, 1);
}

void muon_apply_batch(const ExecContext& ctx, const MuonDeviceProblem* problems, int64_t count,
                      int64_t rows, int64_t cols, bool transpose, const void* w, DType w_type,
                      float step, const int32_t* skips, const float* lr, float weight_decay) {
    if (count == 0 || rows == 0 || cols == 0) return;
    const dim3 grid = tile_grid(rows, cols, count), block(kTile, kTileRows);
    auto launch = [&](auto tr, const auto* o) {
        apply_kernel<decltype(tr)::value><<<grid, block, 0, stream_of(ctx)>>>(
            problems, rows, cols, o, step, skips, lr, weight_decay);
    };
    if (w_type == DType::BF16) {
        const bf* o = static_cast<const bf*>(w);
        transpose ? launch(std::true_type{}, o) : launch(std::false_type{}, o);
    } else if (w_type == DType::F16) {
        const __half* o = static_cast<const __half*>(w);
        transpose ? launch(std::true_type{}, o) : launch(std::false_type{}, o);
    } else {
        const float* o = static_cast<const float*>(w);
        transpose ? launch(std::true_type{}, o) : launch(std::false_type{}, o);
    }
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
