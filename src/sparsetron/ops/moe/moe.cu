// MoE on the device: fp32 router top-k, the expert-major permutation with device-side counts
// (deterministic: block scans in token order), gather/combine, and the grouped expert GEMM that
// reads each expert's row range from device memory (no host read, so it can be captured).
#include <mma.h>

#include <cub/block/block_scan.cuh>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/fp8_block.cuh"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/moe/grouped_gemm_forms.h"
#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda {

namespace {

constexpr int kMaxTopk = 16;

__global__ void router_kernel(const float* logits, const float* bias, const int32_t* row_begin,
                              int64_t tokens, int64_t E, int64_t k, bool force, float scaling,
                              float* probs, int32_t* topk, float* gates) {
    const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (t >= tokens) return;
    float* s = probs + t * E;
    for (int64_t e = 0; e < E; ++e) s[e] = 1.f / (1.f + expf(-logits[t * E + e]));
    int32_t chosen[kMaxTopk];
    if (row_begin[t] < 0) {
        for (int64_t j = 0; j < k; ++j) topk[t * k + j] = -1, gates[t * k + j] = 0.f;
        return;
    }
    for (int64_t j = 0; j < k; ++j) {
        if (force) {
            chosen[j] = int32_t((t * k + j) % E);
            continue;
        }
        int32_t best = -1;
        float bv = -INFINITY;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken |= chosen[i] == e;
            const float v = s[e] + bias[e];
            if (!taken && (best < 0 || v > bv)) best = int32_t(e), bv = v;
        }
        chosen[j] = best;
    }
    double sum = 1e-20;
    for (int64_t j = 0; j < k; ++j) sum += s[chosen[j]];
    for (int64_t j = 0; j < k; ++j) {
        topk[t * k + j] = chosen[j];
        gates[t * k + j] = float(double(s[chosen[j]]) / sum * scaling);
    }
}

constexpr int kScanThreads = 1024;

// Block e: the rank of each of expert e's entries in token order; capacity drops the rest.
__global__ void permute_rank_kernel(const int32_t* topk, int64_t entries, int64_t capacity,
                                    int32_t* counts, int32_t* slot_row) {
    using Scan = cub::BlockScan<int, kScanThreads>;
    __shared__ typename Scan::TempStorage tmp;
    const int32_t e = blockIdx.x;
    int base = 0;
    for (int64_t c0 = 0; c0 < entries; c0 += blockDim.x) {
        const int64_t i = c0 + threadIdx.x;
        const int32_t x = i < entries ? topk[i] : -2;
        const int flag = x == e;
        int rank, total;
        Scan(tmp).ExclusiveSum(flag, rank, total);
        __syncthreads();
        if (flag) slot_row[i] = base + rank < capacity ? base + rank : -1;
        if (e == 0 && i < entries && x < 0) slot_row[i] = -1;  // padding rows are not routed
        base += total;
    }
    if (threadIdx.x == 0) counts[e] = base;
}

__global__ void permute_offsets_kernel(const int32_t* counts, int64_t E, int64_t capacity,
                                       int32_t* offsets) {
    if (threadIdx.x != 0) return;
    int32_t acc = 0;
    offsets[0] = 0;
    for (int64_t e = 0; e < E; ++e)
        offsets[e + 1] = acc += int32_t(min(int64_t(counts[e]), capacity));
}

__global__ void permute_place_kernel(const int32_t* topk, int64_t entries, int64_t k,
                                     const int32_t* offsets, int32_t* slot_row,
                                     int32_t* perm_token) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= entries || slot_row[i] < 0) return;
    const int32_t r = offsets[topk[i]] + slot_row[i];
    slot_row[i] = r;
    perm_token[r] = int32_t(i / k);
}

__global__ void gather_kernel(const bf* x, const int32_t* perm_token, const int32_t* offsets,
                              int64_t E, int64_t dim, bf* out) {
    const int64_t r = blockIdx.x;
    if (r >= offsets[E]) return;
    const bf* src = x + int64_t(perm_token[r]) * dim;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[r * dim + i] = src[i];
}

__global__ void combine_kernel(const bf* out_perm, const int32_t* slot_row, const float* gates,
                               int64_t k, int64_t dim, bf* y) {
    const int64_t t = blockIdx.x;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float acc = ld(y + t * dim + i);
        for (int64_t j = 0; j < k; ++j) {
            const int32_t r = slot_row[t * k + j];
            if (r >= 0) acc += gates[t * k + j] * ld(out_perm + int64_t(r) * dim + i);
        }
        st(y + t * dim + i, acc);
    }
}

// The row kernels above and below with 16-byte accesses of 8 bf16 (dim % 8 == 0, aligned
// pointers): the permuted rows are thousands of elements wide, and 2-byte accesses keep these
// kernels well below the memory bandwidth. Same arithmetic per element, in the same order.
// kFp8: the rows' FP8 copy too (dim8 a multiple of 16: a half-warp holds a 1x128 block, and a
// block's threads stride by 256 chunks, so a half-warp is all in or all out).
template <bool kFp8>
__global__ void gather_vec_kernel(const uint4* x, const int32_t* perm_token, const int32_t* offsets,
                                  int64_t E, int64_t dim8, uint4* out, Fp8RowsOut out8) {
    const int64_t r = blockIdx.x;
    if (r >= offsets[E]) return;
    const uint4* src = x + int64_t(perm_token[r]) * dim8;
    for (int64_t i = threadIdx.x; i < dim8; i += blockDim.x) {
        const uint4 v = src[i];
        out[r * dim8 + i] = v;
        if constexpr (kFp8) {
            float f[8];
            unpack8(v, f);
            fp8_dev::store_row_chunk_fp8(f, out8.pow2, r, i, dim8 * 8, out8.rows, out8.q,
                                         out8.scale_inv);
        }
    }
}

__global__ void combine_vec_kernel(const uint4* out_perm, const int32_t* slot_row,
                                   const float* gates, int64_t k, int64_t dim8, uint4* y) {
    const int64_t t = blockIdx.x;
    for (int64_t i = threadIdx.x; i < dim8; i += blockDim.x) {
        float acc[8], o[8];
        unpack8(y[t * dim8 + i], acc);
        for (int64_t j = 0; j < k; ++j) {
            const int32_t r = slot_row[t * k + j];
            if (r < 0) continue;
            const float g = gates[t * k + j];
            unpack8(out_perm[int64_t(r) * dim8 + i], o);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += g * o[e];
        }
        y[t * dim8 + i] = pack8(acc);
    }
}

// ---- Grouped GEMM: C_e = A_e @ B_e over per-expert logical matrices -------------------------
// The simple fallback: 64x64 tiles, element-wise staging, any shape or alignment.
// A(i, kk) = a[a_off(e) + i * a_si + kk * a_sk], B(kk, j) = b[b_off(e) + kk * b_sk + j * b_sj];
// row/reduction ranges come from `offsets` on the device.
constexpr int BM = 64, BN = 64, BK = 32, kGemmThreads = 128;

struct GroupedArgs {
    GroupedGemm kind;
    const int32_t* offsets;
    int64_t n, k, wstride;
    bool accumulate;
    bool grad_bf16;  // WeightGrad into a bf16 gradient
    const bf *a, *b;
    void* c;
};

__global__ void grouped_gemm_kernel(GroupedArgs g) {
    using namespace nvcuda;
    __shared__ __align__(32) bf As[BM][BK + 8];
    __shared__ __align__(32) bf Bs[BK][BN + 8];
    __shared__ __align__(32) float Cs[BM][BN + 4];
    const int64_t e = blockIdx.z;
    const int64_t r0 = g.offsets[e], rows = g.offsets[e + 1] - r0;
    // Logical sizes M x N, reduction K, and the strides of this kind.
    int64_t M, N, K, a_si, a_sk, b_sk, b_sj;
    const bf *A, *B;
    switch (g.kind) {
        case GroupedGemm::RowsTimesWeightT:  // [rows, k] x W_e^T -> [rows, n]
            M = rows, N = g.n, K = g.k;
            A = g.a + r0 * g.k, a_si = g.k, a_sk = 1;
            B = g.b + e * g.wstride, b_sk = 1, b_sj = g.k;
            break;
        case GroupedGemm::RowsTimesWeight:  // [rows, n] x W_e -> [rows, k]
            M = rows, N = g.k, K = g.n;
            A = g.a + r0 * g.n, a_si = g.n, a_sk = 1;
            B = g.b + e * g.wstride, b_sk = g.k, b_sj = 1;
            break;
        default:  // WeightGrad: A_e^T [n, rows] x B_e [rows, k] -> [n, k]
            M = g.n, N = g.k, K = rows;
            A = g.a + r0 * g.n, a_si = 1, a_sk = g.n;
            B = g.b + r0 * g.k, b_sk = g.k, b_sj = 1;
            break;
    }
    const int64_t i0 = int64_t(blockIdx.y) * BM, j0 = int64_t(blockIdx.x) * BN;
    if (i0 >= M || j0 >= N) return;
    const int warp = threadIdx.x >> 5, wi = warp >> 1, wj = warp & 1;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (auto& row : acc)
        for (auto& f : row) wmma::fill_fragment(f, 0.f);
    const bf zero = __float2bfloat16(0.f);
    for (int64_t k0 = 0; k0 < K; k0 += BK) {
        // Stage the tiles; the unit-stride index runs fastest so loads coalesce.
        for (int l = threadIdx.x; l < BM * BK; l += blockDim.x) {
            const int ii = a_sk == 1 ? l / BK : l % BM, kk = a_sk == 1 ? l % BK : l / BM;
            const int64_t gi = i0 + ii, gk = k0 + kk;
            As[ii][kk] = gi < M && gk < K ? A[gi * a_si + gk * a_sk] : zero;
        }
        for (int l = threadIdx.x; l < BK * BN; l += blockDim.x) {
            const int kk = b_sj == 1 ? l / BN : l % BK, jj = b_sj == 1 ? l % BN : l / BK;
            const int64_t gk = k0 + kk, gj = j0 + jj;
            Bs[kk][jj] = gk < K && gj < N ? B[gk * b_sk + gj * b_sj] : zero;
        }
        __syncthreads();
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb[2];
            for (int x = 0; x < 2; ++x) {
                wmma::load_matrix_sync(fa[x], &As[wi * 32 + x * 16][kk], BK + 8);
                wmma::load_matrix_sync(fb[x], &Bs[kk][wj * 32 + x * 16], BN + 8);
            }
            for (int x = 0; x < 2; ++x)
                for (int y = 0; y < 2; ++y) wmma::mma_sync(acc[x][y], fa[x], fb[y], acc[x][y]);
        }
        __syncthreads();
    }
    for (int x = 0; x < 2; ++x)
        for (int y = 0; y < 2; ++y)
            wmma::store_matrix_sync(&Cs[wi * 32 + x * 16][wj * 32 + y * 16], acc[x][y], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int l = threadIdx.x; l < BM * BN; l += blockDim.x) {
        const int ii = l / BN, jj = l % BN;
        const int64_t gi = i0 + ii, gj = j0 + jj;
        if (gi >= M || gj >= N) continue;
        if (g.kind == GroupedGemm::WeightGrad && g.grad_bf16) {
            bf* c = static_cast<bf*>(g.c) + e * g.wstride + gi * N + gj;
            *c = __float2bfloat16(g.accumulate ? __bfloat162float(*c) + Cs[ii][jj] : Cs[ii][jj]);
        } else if (g.kind == GroupedGemm::WeightGrad) {
            float* c = static_cast<float*>(g.c) + e * g.wstride + gi * N + gj;
            *c = g.accumulate ? *c + Cs[ii][jj] : Cs[ii][jj];  // an empty expert: 0 (K = 0)
        } else {
            bf* c = static_cast<bf*>(g.c) + r0 * N + gi * N + gj;
            *c = __float2bfloat16(g.accumulate ? __bfloat162float(*c) + Cs[ii][jj] : Cs[ii][jj]);
        }
    }
}

// The gate-gradient kernels run one block per (token, choice) (blockIdx.x, blockIdx.y): the
// choice's permuted row, or -1 for an unrouted choice, whose gate gradient is 0 (written here).
__device__ __forceinline__ int32_t choice_row(const int32_t* slot_row, int64_t k, float* dgates) {
    const int64_t c = int64_t(blockIdx.x) * k + blockIdx.y;
    const int32_t r = slot_row[c];
    if (r < 0 && threadIdx.x == 0) dgates[c] = 0.f;
    return r;
}
// The block's sum of the choice's gate-gradient terms into dgates.
__device__ __forceinline__ void store_gate_grad(float s, int64_t k, float* dgates) {
    s = block_sum(s);
    if (threadIdx.x == 0) dgates[int64_t(blockIdx.x) * k + blockIdx.y] = s;
}

__global__ void combine_bwd_kernel(const bf* dy, const bf* out_perm, const int32_t* slot_row,
                                   const float* gates, int64_t k, int64_t dim, bf* dout_perm,
                                   float* dgates) {
    const int32_t r = choice_row(slot_row, k, dgates);
    if (r < 0) return;
    const int64_t t = blockIdx.x;
    const float gate = gates[t * k + blockIdx.y];
    float s = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = ld(dy + t * dim + i);
        s += d * ld(out_perm + int64_t(r) * dim + i);
        st(dout_perm + int64_t(r) * dim + i, gate * d);
    }
    store_gate_grad(s, k, dgates);
}

__global__ void gather_bwd_kernel(const bf* dx_perm, const int32_t* slot_row, int64_t k,
                                  int64_t dim, bf* dx, bool accumulate) {
    const int64_t t = blockIdx.x;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float acc = accumulate ? ld(dx + t * dim + i) : 0.f;
        for (int64_t j = 0; j < k; ++j) {
            const int32_t r = slot_row[t * k + j];
            if (r >= 0) acc += ld(dx_perm + int64_t(r) * dim + i);
        }
        st(dx + t * dim + i, acc);
    }
}

// kFp8: dout_perm's FP8 copy too (dim8 a multiple of 16), quantized from the bf16 values written.
template <bool kFp8>
__global__ void combine_bwd_vec_kernel(const uint4* dy, const uint4* out_perm,
                                       const int32_t* slot_row, const float* gates, int64_t k,
                                       int64_t dim8, uint4* dout_perm, float* dgates,
                                       Fp8RowsOut dout8) {
    const int32_t r = choice_row(slot_row, k, dgates);
    if (r < 0) return;
    const int64_t t = blockIdx.x;
    const float gate = gates[t * k + blockIdx.y];
    float s = 0;
    for (int64_t i = threadIdx.x; i < dim8; i += blockDim.x) {
        float d[8], o[8];
        unpack8(dy[t * dim8 + i], d);
        unpack8(out_perm[int64_t(r) * dim8 + i], o);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            s += d[e] * o[e];
            d[e] *= gate;
        }
        const uint4 written = pack8(d);
        dout_perm[int64_t(r) * dim8 + i] = written;
        if constexpr (kFp8) {
            unpack8(written, d);  // the rounded values, as a separate quantization reads them
            fp8_dev::store_row_chunk_fp8(d, dout8.pow2, r, i, dim8 * 8, dout8.rows, dout8.q,
                                         dout8.scale_inv);
        }
    }
    store_gate_grad(s, k, dgates);
}

// kVec: rows of 8-value vectors (inner, dim multiples of 8).
template <bool kVec>
__global__ void gate_bwd_rows_kernel(bf* du, const bf* act, const int32_t* slot_row,
                                     const float* gates, int64_t k, int64_t inner, int64_t dim,
                                     bf* dout_perm, float* dgates) {
    const int32_t r = choice_row(slot_row, k, dgates);
    if (r < 0) return;
    const int64_t t = blockIdx.x;
    const float gate = gates[t * k + blockIdx.y];
    float s = 0;
    bf* dur = du + int64_t(r) * inner;
    const bf* ar = act + int64_t(r) * inner;
    bf* dor = dout_perm + int64_t(r) * dim;
    if constexpr (kVec) {
        uint4* du8 = reinterpret_cast<uint4*>(dur);
        const uint4* a8 = reinterpret_cast<const uint4*>(ar);
        for (int64_t i = threadIdx.x; i < inner / 8; i += blockDim.x) {
            float d[8], a[8];
            unpack8(du8[i], d);
            unpack8(a8[i], a);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                s += d[e] * a[e];
                d[e] *= gate;
            }
            du8[i] = pack8(d);
        }
        uint4* do8 = reinterpret_cast<uint4*>(dor);
        for (int64_t i = threadIdx.x; i < dim / 8; i += blockDim.x) {
            float d[8];
            unpack8(do8[i], d);
#pragma unroll
            for (int e = 0; e < 8; ++e) d[e] *= gate;
            do8[i] = pack8(d);
        }
    } else {
        for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) {
            const float d = ld(dur + i);
            s += d * ld(ar + i);
            st(dur + i, gate * d);
        }
        for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) st(dor + i, gate * ld(dor + i));
    }
    store_gate_grad(s, k, dgates);
}

__global__ void gather_bwd_vec_kernel(const uint4* dx_perm, const int32_t* slot_row, int64_t k,
                                      int64_t dim8, uint4* dx, bool accumulate) {
    const int64_t t = blockIdx.x;
    for (int64_t i = threadIdx.x; i < dim8; i += blockDim.x) {
        float acc[8], v[8];
        if (accumulate)
            unpack8(dx[t * dim8 + i], acc);
        else
            for (int e = 0; e < 8; ++e) acc[e] = 0.f;
        for (int64_t j = 0; j < k; ++j) {
            const int32_t r = slot_row[t * k + j];
            if (r < 0) continue;
            unpack8(dx_perm[int64_t(r) * dim8 + i], v);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += v[e];
        }
        dx[t * dim8 + i] = pack8(acc);
    }
}

__global__ void router_bwd_kernel(const float* probs, const int32_t* topk, const float* dgates,
                                  int64_t tokens, int64_t E, int64_t k, float scaling,
                                  float* dlogits) {
    const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (t >= tokens) return;
    float* dl = dlogits + t * E;
    for (int64_t e = 0; e < E; ++e) dl[e] = 0.f;
    if (topk[t * k] < 0) return;
    const float* s = probs + t * E;
    // g_j = scaling * s_j / S with S = eps + Σ s_chosen: ds_i = scaling (dg_i / S - Σ_j dg_j s_j /
    // S²).
    double S = 1e-20, dot = 0;
    for (int64_t j = 0; j < k; ++j) S += s[topk[t * k + j]];
    for (int64_t j = 0; j < k; ++j) dot += double(dgates[t * k + j]) * s[topk[t * k + j]];
    for (int64_t j = 0; j < k; ++j) {
        const int32_t e = topk[t * k + j];
        const double ds = scaling * (dgates[t * k + j] / S - dot / (S * S));
        dl[e] += float(ds * s[e] * (1.0 - s[e]));  // through the sigmoid
    }
}

__global__ void count_load_kernel(const int32_t* counts, int64_t E, int64_t capacity, int64_t* load,
                                  int64_t* dropped) {
    if (threadIdx.x != 0) return;
    int64_t d = 0;
    for (int64_t e = 0; e < E; ++e) {
        load[e] += counts[e];
        d += counts[e] > capacity ? counts[e] - capacity : 0;
    }
    *dropped += d;
}

__global__ void update_bias_kernel(const int64_t* load, int64_t E, float rate, float* bias) {
    if (threadIdx.x != 0) return;
    double mean = 0;
    for (int64_t e = 0; e < E; ++e) mean += double(load[e]);
    mean /= double(E);
    for (int64_t e = 0; e < E; ++e) {
        const double d = mean - double(load[e]);
        bias[e] += rate * float((d > 0) - (d < 0));
    }
}

}  // namespace

void moe_combine_backward(const ExecContext& ctx, const bf16* dy, const bf16* out_perm,
                          const int32_t* slot_row, const float* gates, int64_t tokens, int64_t k,
                          int64_t dim, bf16* dout_perm, float* dgates, const Fp8RowsOut& dout8) {
    if (tokens == 0) return;
    if (dout8.q && dim % 128 == 0 && aligned16(dy, out_perm, dout_perm, dout8.q)) {
        combine_bwd_vec_kernel<true><<<dim3(tokens, k), 256, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(dy), reinterpret_cast<const uint4*>(out_perm), slot_row,
            gates, k, dim / 8, reinterpret_cast<uint4*>(dout_perm), dgates, dout8);
        ST_CUDA_LAUNCH_CHECK();
        return;
    }
    if (dim % 8 == 0 && aligned16(dy, out_perm, dout_perm))
        combine_bwd_vec_kernel<false><<<dim3(tokens, k), 256, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(dy), reinterpret_cast<const uint4*>(out_perm), slot_row,
            gates, k, dim / 8, reinterpret_cast<uint4*>(dout_perm), dgates, Fp8RowsOut{});
    else
        combine_bwd_kernel<<<dim3(tokens, k), 256, 0, stream_of(ctx)>>>(
            dev(dy), dev(out_perm), slot_row, gates, k, dim, dev(dout_perm), dgates);
    ST_CUDA_LAUNCH_CHECK();
    if (dout8.q)
        quantize_fp8_1x128(ctx, dout_perm, dout8.rows, dim, dim, dout8.pow2, dout8.q,
                           dout8.scale_inv);
}

void moe_gate_backward_rows(const ExecContext& ctx, bf16* du, const bf16* act,
                            const int32_t* slot_row, const float* gates, int64_t tokens, int64_t k,
                            int64_t inner, int64_t dim, bf16* dout_perm, float* dgates) {
    if (tokens == 0) return;
    const dim3 grid{unsigned(tokens), unsigned(k)};
    if (inner % 8 == 0 && dim % 8 == 0 && aligned16(du, act, dout_perm))
        gate_bwd_rows_kernel<true><<<grid, 256, 0, stream_of(ctx)>>>(
            dev(du), dev(act), slot_row, gates, k, inner, dim, dev(dout_perm), dgates);
    else
        gate_bwd_rows_kernel<false><<<grid, 256, 0, stream_of(ctx)>>>(
            dev(du), dev(act), slot_row, gates, k, inner, dim, dev(dout_perm), dgates);
    ST_CUDA_LAUNCH_CHECK();
}

void moe_gather_backward(const ExecContext& ctx, const bf16* dx_perm, const int32_t* slot_row,
                         int64_t tokens, int64_t k, int64_t dim, bf16* dx, bool accumulate) {
    if (tokens == 0) return;
    if (dim % 8 == 0 && aligned16(dx_perm, dx))
        gather_bwd_vec_kernel<<<tokens, 256, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(dx_perm), slot_row, k, dim / 8,
            reinterpret_cast<uint4*>(dx), accumulate);
    else
        gather_bwd_kernel<<<tokens, 256, 0, stream_of(ctx)>>>(dev(dx_perm), slot_row, k, dim,
                                                              dev(dx), accumulate);
    ST_CUDA_LAUNCH_CHECK();
}

void router_backward(const ExecContext& ctx, const float* probs, const int32_t* topk,
                     const float* dgates, int64_t tokens, int64_t experts, int64_t k, float scaling,
                     float* dlogits) {
    if (tokens == 0) return;
    router_bwd_kernel<<<blocks_for(tokens, 128), 128, 0, stream_of(ctx)>>>(
        probs, topk, dgates, tokens, experts, k, scaling, dlogits);
    ST_CUDA_LAUNCH_CHECK();
}

void moe_count_load(const ExecContext& ctx, const int32_t* counts, int64_t experts,
                    int64_t capacity, int64_t* load, int64_t* dropped) {
    count_load_kernel<<<1, 32, 0, stream_of(ctx)>>>(counts, experts, capacity, load, dropped);
    ST_CUDA_LAUNCH_CHECK();
}

void moe_update_bias(const ExecContext& ctx, const int64_t* load, int64_t experts, float rate,
                     float* bias) {
    update_bias_kernel<<<1, 32, 0, stream_of(ctx)>>>(load, experts, rate, bias);
    ST_CUDA_LAUNCH_CHECK();
}

void router_topk(const ExecContext& ctx, const float* logits, const float* bias,
                 const int32_t* row_begin, int64_t tokens, int64_t experts, int64_t k,
                 bool force_balance, float scaling, float* probs, int32_t* topk, float* gates) {
    ST_CHECK(k <= kMaxTopk && k <= experts, "router_topk: top-", k, " of ", experts,
             " experts is not supported (at most ", kMaxTopk, ")");
    if (tokens == 0) return;
    router_kernel<<<blocks_for(tokens, 128), 128, 0, stream_of(ctx)>>>(
        logits, bias, row_begin, tokens, experts, k, force_balance, scaling, probs, topk, gates);
    ST_CUDA_LAUNCH_CHECK();
}

void moe_permute(const ExecContext& ctx, const int32_t* topk, int64_t tokens, int64_t experts,
                 int64_t k, int64_t capacity, int32_t* counts, int32_t* offsets, int32_t* slot_row,
                 int32_t* perm_token) {
    cudaStream_t s = stream_of(ctx);
    const int64_t entries = tokens * k;
    permute_rank_kernel<<<experts, kScanThreads, 0, s>>>(topk, entries, capacity, counts, slot_row);
    permute_offsets_kernel<<<1, 32, 0, s>>>(counts, experts, capacity, offsets);
    if (entries > 0)
        permute_place_kernel<<<blocks_for(entries, 256), 256, 0, s>>>(topk, entries, k, offsets,
                                                                      slot_row, perm_token);
    ST_CUDA_LAUNCH_CHECK();
}

void moe_gather(const ExecContext& ctx, const bf16* x, const int32_t* perm_token,
                const int32_t* offsets, int64_t experts, int64_t rows, int64_t dim, bf16* out,
                const Fp8RowsOut& out8) {
    if (rows == 0) return;
    if (out8.q && dim % 128 == 0 && aligned16(x, out, out8.q)) {
        gather_vec_kernel<true><<<rows, 256, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(x), perm_token, offsets, experts, dim / 8,
            reinterpret_cast<uint4*>(out), out8);
        ST_CUDA_LAUNCH_CHECK();
        return;
    }
    if (dim % 8 == 0 && aligned16(x, out))
        gather_vec_kernel<false><<<rows, 256, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(x), perm_token, offsets, experts, dim / 8,
            reinterpret_cast<uint4*>(out), Fp8RowsOut{});
    else
        gather_kernel<<<rows, 256, 0, stream_of(ctx)>>>(dev(x), perm_token, offsets, experts, dim,
                                                        dev(out));
    ST_CUDA_LAUNCH_CHECK();
    if (out8.q)
        quantize_fp8_1x128(ctx, out, out8.rows, dim, dim, out8.pow2, out8.q, out8.scale_inv);
}

void moe_combine(const ExecContext& ctx, const bf16* out_perm, const int32_t* slot_row,
                 const float* gates, int64_t tokens, int64_t k, int64_t dim, bf16* y) {
    if (tokens == 0) return;
    if (dim % 8 == 0 && aligned16(out_perm, y))
        combine_vec_kernel<<<tokens, 256, 0, stream_of(ctx)>>>(
            reinterpret_cast<const uint4*>(out_perm), slot_row, gates, k, dim / 8,
            reinterpret_cast<uint4*>(y));
    else
        combine_kernel<<<tokens, 256, 0, stream_of(ctx)>>>(dev(out_perm), slot_row, gates, k, dim,
                                                           dev(y));
    ST_CUDA_LAUNCH_CHECK();
}

GroupedGemmShape grouped_gemm_shape(const GroupedGemmArgs& g) {
    const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    return {g.n, g.k, g.weight_stride, aligned(g.a) && aligned(g.b) && aligned(g.c), has_sm90a()};
}

void grouped_gemm(const ExecContext& ctx, const GroupedGemmArgs& g) {
    grouped_gemm(ctx, plan_grouped_gemm(grouped_gemm_shape(g)), g);
}

void grouped_gemm(const ExecContext& ctx, GroupedGemmForm form, const GroupedGemmArgs& g) {
    if (g.experts == 0) return;
    // The kernels' bulk tensor loads are bounded by the row buffers' capacity: a capacity below
    // what an expert may hold would read its rows as zeros.
    ST_CHECK(g.row_capacity >= g.max_rows, "grouped_gemm: the row buffers hold ", g.row_capacity,
             " rows, fewer than one expert's bound of ", g.max_rows);
    switch (form) {
        case GroupedGemmForm::Wgmma:
            grouped_gemm_wgmma(ctx, g);
            return;
        case GroupedGemmForm::Wmma:
            grouped_gemm_wmma(ctx, g);
            return;
        case GroupedGemmForm::Simple:
            break;
    }
    // Grid: the worst case per expert; tiles past an expert's actual rows exit at once.
    int64_t M, N;
    switch (g.kind) {
        case GroupedGemm::RowsTimesWeightT:
            M = g.max_rows, N = g.n;
            break;
        case GroupedGemm::RowsTimesWeight:
            M = g.max_rows, N = g.k;
            break;
        default:
            M = g.n, N = g.k;
            break;
    }
    if (M == 0 || N == 0) return;
    const int64_t weight_stride = g.weight_stride ? g.weight_stride : g.n * g.k;
    dim3 grid(blocks_for(N, BN), blocks_for(M, BM), static_cast<unsigned>(g.experts));
    grouped_gemm_kernel<<<grid, kGemmThreads, 0, stream_of(ctx)>>>(GroupedArgs{
        g.kind, g.offsets, g.n, g.k, weight_stride, g.accumulate,
        g.kind == GroupedGemm::WeightGrad && g.grad_type == DType::BF16, dev(g.a), dev(g.b), g.c});
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
