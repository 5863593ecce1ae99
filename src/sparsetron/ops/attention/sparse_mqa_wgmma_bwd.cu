// Sparse MQA backward on wgmma (sm_90), flash-style, at the GLM-5 shape (64 heads, qk 576, v 512 =
// the latent part of the same key rows). One block per query token, two warpgroups; the token's
// selected keys go through in chunks of 64 (sparse_mqa_wgmma.cuh's tiles and copies).
//
// Math (SPEC §3's absorbed sparse MQA; scale on the dot products): per chunk of keys K (V = its
// first 512 dims), P = exp(scale Q K^T - lse) recomputed from the forward's lse, dP = dO V^T,
// dS = scale P (dP - delta) with delta = rowsum(dO o O); dQ += dS K; dK' = dS^T Q and
// dV = P^T dO, both added into the fp32 dkv rows of the chunk's keys.
//
// Per chunk: each warpgroup computes S and dP for 32 of the keys (m64n32, both in one commit) and
// writes its P and dS (bf16) into shared [64 heads][64 keys] tiles. dQ stays in registers across
// the chunks: warpgroup w holds latent dims 256 w .. 256 w + 255 (m64n256, K = the chunk's 64 keys
// read MN-major from the key tile) and a partial of the 64 rope dims over its 32 keys (summed at
// the end). Then the key tile is free: the next chunk's gather starts, and overlaps the dK'/dV'
// blocks, which read only Q, dO, P and dS: per block of 64 dims, M = the chunk's 64 keys, N = 64
// dims, K = 64 heads, A = dS^T (and P^T) and B = Q's (and dO's) slice, all MN-major reads of the
// tiles; warpgroup 0 takes latent blocks 0, 2, 4, 6 and warpgroup 1 blocks 1, 3, 5, 7; both
// compute the rope block (no dV) over all heads and each adds half of its dims (twice the rope
// block's MMAs, half its reductions, which the L2 is bound by). Each block's accumulator goes to
// dkv as 16-byte vector reductions (four dims: neighbouring lanes swap pairs first), half the
// reduction requests of pairs, which the L2 is bound by.
//
// Shared memory: Q 72 KiB, dO 64 KiB, one key chunk 72 KiB, P and dS 16 KiB: one key buffer (the
// forward's second buffer does not fit beside dO).
// Its speed at 4K and 32K (an order of magnitude over the gathered kernels at 32K) and its profile
// (L2-bound by the dkv reductions; long-scoreboard waits on the reductions' key index and on
// spill reloads at 255 registers): docs/perf/README.md and docs/perf/log/.
#include <cmath>

#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/attention/sparse_mqa_wgmma.cuh"
#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda {

namespace {

using namespace flash_mqa;
constexpr int kDoBytes = (kDv / 64) * kSliceBytes;
// Alignment slack, Q, the key chunk, dO, P, dS, delta and lse (log2 units) per head.
constexpr size_t kBwdSmemBytes =
    1024 + 2 * size_t(kTileBytes) + kDoBytes + 2 * kSliceBytes + 2 * kH * 4;
static_assert(kBwdSmemBytes <= 227 * 1024, "shared memory per block");
[[maybe_unused]] constexpr float kLog2e = 1.44269504f;

#ifdef ST_WGMMA
// One dK'/dV' block of 64 dims (M = the chunk's 64 keys, N = 64 dims, K = heads): acc = dS^T
// Q_slice over k16 steps kk0 .. kk0 + kSteps - 1, plus P^T dO_slice over all four with kWithDv;
// every operand read MN-major from its [64 heads][64] tile. Issued and waited for.
template <int kSteps, bool kWithDv>
__device__ __forceinline__ void dkv_block(float (&acc)[32], uint64_t d_dst, uint64_t d_pt,
                                          uint32_t q_slice, uint32_t do_slice, int kk0) {
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    mma_fence();
    const uint64_t d_q = mn_major(q_slice);
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
        const int kk = kk0 + k;
        wgmma::mma_m64k16<1, 1>(acc, desc_plus(d_dst, kk * 2048), desc_plus(d_q, kk * 2048));
    }
    if constexpr (kWithDv) {
        const uint64_t d_do = mn_major(do_slice);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma::mma_m64k16<1, 1>(acc, desc_plus(d_pt, kk * 2048), desc_plus(d_do, kk * 2048));
    }
    mma_commit();
    mma_wait();
}
#endif

// The reductions' dkv rows are loaded from the selection while the chunk's S / dP MMAs run.
// Reading them from shared memory instead (written at the gather) measured slower.
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mqa_bwd_wgmma_kernel(const bf* q, const bf* kv, const int32_t* idx, const int32_t* len,
                                int64_t kslots, int64_t tokens, float scale, const bf* out,
                                const float* lse, const bf* dout, bf* dq, float* dkv) {
#ifdef ST_WGMMA
    using namespace wgmma;
    extern __shared__ unsigned char smem_raw[];
    const auto [base, gbase] = aligned_smem_base(smem_raw);
    const uint32_t q_tile = base, k_tile = base + kTileBytes, do_tile = base + 2 * kTileBytes;
    const uint32_t p_tile = do_tile + kDoBytes, ds_tile = p_tile + kSliceBytes;
    unsigned char* p_gen = gbase + (p_tile - base);
    unsigned char* ds_gen = gbase + (ds_tile - base);
    float* delta = reinterpret_cast<float*>(gbase + (ds_tile - base) + kSliceBytes);  // [64]
    float* lse2 = delta + kH;                                                         // [64]

    const int64_t t = blockIdx.x, n = len[t];
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int quad = lane & 3, r0 = warp * 16 + lane / 4;  // this thread's rows: r0, r0 + 8
    bf* dq_row = dq + t * kH * kD;
    if (n == 0) {  // no selected key: dQ 0, nothing into dkv
        for (int i = tid; i < kH * kD; i += kThreads) dq_row[i] = __float2bfloat16(0.f);
        return;
    }
    const int32_t* sel = idx + t * kslots;
    const int64_t chunks = (n + kChunk - 1) / kChunk;

    // Q, dO and chunk 0 in flight; chunk 1's keys in `keys`.
    {
        const int r = tid >> 3;
        const bf* qrows[2] = {q + (t * kH + r) * kD, q + (t * kH + r + 32) * kD};
        const bf* dorows[2] = {dout + (t * kH + r) * kDv, dout + (t * kH + r + 32) * kDv};
        const bool all[2] = {true, true};
        load_rows<kSlices>(q_tile, qrows, all);
        load_rows<kDv / 64>(do_tile, dorows, all);
    }
    int32_t keys[2];
    chunk_keys(sel, n, 0, keys);
    gather_chunk(k_tile, kv, keys);
    cp_async_commit();
    chunk_keys(sel, n, 1, keys);
    // delta_h = dO_h . O_h (warp w: heads 8 w .. 8 w + 7) and lse in log2 units, while the copies
    // fly; the first chunk's barrier publishes them.
    for (int hh = 0; hh < 8; ++hh) {
        const int h = (tid >> 5) * 8 + hh;
        const bf* o_h = out + (t * kH + h) * kDv;
        const bf* do_h = dout + (t * kH + h) * kDv;
        float acc = 0.f;
#pragma unroll
        for (int part = 0; part < 2; ++part) {
            const uint4 a = *reinterpret_cast<const uint4*>(o_h + part * 256 + lane * 8);
            const uint4 b = *reinterpret_cast<const uint4*>(do_h + part * 256 + lane * 8);
            const auto* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
            const auto* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 x = __bfloat1622float2(a2[k]), y = __bfloat1622float2(b2[k]);
                acc += x.x * y.x + x.y * y.y;
            }
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
        if (lane == 0) delta[h] = acc;
    }
    if (tid < kH) lse2[tid] = lse[int64_t(tid) * tokens + t] * kLog2e;

    const float scale_log2 = scale * kLog2e;
    const uint64_t d_q = k_major(q_tile), d_do = k_major(do_tile), d_ds = k_major(ds_tile);
    const uint64_t d_keys = k_major(k_tile + wg * 32 * 128);  // this warpgroup's 32 key rows
    float dq_acc[128];                                        // dims 256 wg .. 256 wg + 255
    float dq_rope[32];  // dims 512 .. 575, over this warpgroup's 32 keys of each chunk
#pragma unroll
    for (int i = 0; i < 128; ++i) dq_acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) dq_rope[i] = 0.f;

    for (int64_t c = 0; c < chunks; ++c) {
        copies_landed();  // chunk c; P, dS and the previous chunk's MMAs are done
        float s[16], dp[16];
        chunk_dots<kSlices>(s, d_q, d_keys);
        chunk_dots<kDv / 64>(dp, d_do, d_keys);
        mma_commit();
        // The dkv rows of this thread's accumulator rows in the dK'/dV' blocks (keys r0, r0 + 8).
        int32_t red_key[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int64_t j = c * kChunk + r0 + 8 * half;
            red_key[half] = j < n ? sel[j] : -1;
        }
        mma_wait();
        const bool partial = c * kChunk + kChunk > n;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = r0 + 8 * half, col = 32 * wg + 8 * i + 2 * quad;
                float p[2], ds[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int k = 4 * i + 2 * half + e;
                    const bool valid = !partial || c * kChunk + col + e < n;
                    p[e] = valid ? exp2f(s[k] * scale_log2 - lse2[row]) : 0.f;
                    ds[e] = scale * p[e] * (dp[k] - delta[row]);
                }
                const int off = row * 128 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2;
                *reinterpret_cast<__nv_bfloat162*>(p_gen + off) = __floats2bfloat162_rn(p[0], p[1]);
                *reinterpret_cast<__nv_bfloat162*>(ds_gen + off) =
                    __floats2bfloat162_rn(ds[0], ds[1]);
            }
        fence_async_proxy();  // P, dS
        __syncthreads();
        // dQ += dS K: A = dS [64 heads][64 keys] K-major; B = the key tile read MN-major (key
        // rows the reduction): slices 4 wg .. 4 wg + 3, and slice 8 over this warpgroup's keys.
        mma_fence();
        {
            const uint64_t d_k = mn_major(k_tile + 4 * wg * kSliceBytes);
            const uint64_t d_rope = mn_major(k_tile + 8 * kSliceBytes);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                mma_m64k16<0, 1>(dq_acc, desc_plus(d_ds, kk * 32), desc_plus(d_k, kk * 2048));
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
                const int kk = 2 * wg + k2;
                mma_m64k16<0, 1>(dq_rope, desc_plus(d_ds, kk * 32), desc_plus(d_rope, kk * 2048));
            }
        }
        mma_commit();
        mma_wait();
        __syncthreads();  // both warpgroups are done with the key tile
        if (c + 1 < chunks) {
            gather_chunk(k_tile, kv, keys);
            chunk_keys(sel, n, c + 2, keys);
        }
        cp_async_commit();  // possibly empty
        // dK'/dV' blocks of 64 dims: warpgroup w takes latent blocks w, 2 + w, 4 + w, 6 + w
        // (dS^T Q + P^T dO) and, of the rope block (dS^T Q over all heads, computed by both),
        // dims 32 w .. 32 w + 31. The same code path in both warpgroups: wgmma in a branch that
        // depends on the warpgroup is serialized by ptxas (C7520).
        // acc[4 i + 2 half + e] is key r0 + 8 half, dim 64 b + 8 i + 2 quad + e.
        // Adds dims 16 m0 .. 16 m1 - 1 of block b (the whole block: m0 = 0, m1 = 4).
        auto reduce_block = [&](const float(&acc)[32], int b, int m0, int m1) {
            // Lanes quad and quad ^ 1 hold neighbouring dim pairs of the same key: the even
            // lane of the two takes the four dims of even i, the odd lane those of odd i,
            // swapping the other pair (all lanes shuffle: invalid keys skip only the adds).
            const bool odd = quad & 1;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float g[4][4];
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const int lo = 4 * (2 * m) + 2 * half, hi = 4 * (2 * m + 1) + 2 * half;
                    const float s0 = odd ? acc[lo] : acc[hi];
                    const float s1 = odd ? acc[lo + 1] : acc[hi + 1];
                    const float r0v = __shfl_xor_sync(0xffffffffu, s0, 1);
                    const float r1v = __shfl_xor_sync(0xffffffffu, s1, 1);
                    g[m][0] = odd ? r0v : acc[lo];
                    g[m][1] = odd ? r1v : acc[lo + 1];
                    g[m][2] = odd ? acc[hi] : r0v;
                    g[m][3] = odd ? acc[hi + 1] : r1v;
                }
                if (red_key[half] < 0) continue;
                float* dst = dkv + int64_t(red_key[half]) * kD + b * 64 + 4 * (quad >> 1);
#pragma unroll
                for (int m = 0; m < 4; ++m)
                    if (m >= m0 && m < m1)
                        red_add4(dst + 8 * (2 * m + odd), g[m][0], g[m][1], g[m][2], g[m][3]);
            }
        };
        const uint64_t d_dst = mn_major(ds_tile), d_pt = mn_major(p_tile);
        float acc[32];
#pragma unroll 1
        for (int j = 0; j < 4; ++j) {
            const int b = 2 * j + wg;
            dkv_block<4, true>(acc, d_dst, d_pt, q_tile + b * kSliceBytes,
                               do_tile + b * kSliceBytes, 0);
            reduce_block(acc, b, 0, 4);
        }
        // The rope block over all heads in both warpgroups, each reducing half of its dims.
        dkv_block<4, false>(acc, d_dst, d_pt, q_tile + 8 * kSliceBytes, 0, 0);
        reduce_block(acc, 8, 2 * wg, 2 * wg + 2);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // dQ out: the latent dims from each warpgroup; the rope dims as warpgroup 1's partial (through
    // the P / dS tiles, free now) plus warpgroup 0's.
    __syncthreads();                                     // every MMA reading P / dS is done
    float* rope_part = reinterpret_cast<float*>(p_gen);  // [64 heads][64 dims] fp32, 16 KiB
    if (wg == 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    rope_part[(r0 + 8 * half) * 64 + 8 * i + 2 * quad + e] =
                        dq_rope[4 * i + 2 * half + e];
    }
    __syncthreads();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = r0 + 8 * half;
        bf* drow = dq_row + row * kD;
#pragma unroll
        for (int i = 0; i < 32; ++i)
            *reinterpret_cast<__nv_bfloat162*>(drow + 256 * wg + 8 * i + 2 * quad) =
                __floats2bfloat162_rn(dq_acc[4 * i + 2 * half], dq_acc[4 * i + 2 * half + 1]);
        if (wg == 0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int col = 8 * i + 2 * quad;
                *reinterpret_cast<__nv_bfloat162*>(drow + 512 + col) = __floats2bfloat162_rn(
                    dq_rope[4 * i + 2 * half] + rope_part[row * 64 + col],
                    dq_rope[4 * i + 2 * half + 1] + rope_part[row * 64 + col + 1]);
            }
        }
    }
#else
    __trap();  // dispatched only on sm_90 (sparse_mqa_forward_wgmma_supported)
#endif
}

}  // namespace

void sparse_mqa_backward_wgmma(const ExecContext& ctx, const SparseMqa& p, const bf16* out,
                               const float* lse, const bf16* dout, bf16* dq, float* dkv) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16 *q = p.q, *kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    const int64_t key_rows = p.key_rows;
    ST_CHECK(sparse_mqa_forward_wgmma_supported(heads, dqk, dv),
             "sparse_mqa_backward_wgmma: ", heads, " heads, qk ", dqk, ", v ", dv,
             " (needs sm_90 and the GLM-5 shape 64 / 576 / 512)");
    if (tokens == 0) return;
    const int64_t keys = std::max(tokens, key_rows);
    if (!p.dkv_accumulate)
        ST_CUDA_CHECK(cudaMemsetAsync(dkv, 0, keys * dqk * sizeof(float), stream_of(ctx)));
    allow_dynamic_smem<sparse_mqa_bwd_wgmma_kernel>(kBwdSmemBytes);
    sparse_mqa_bwd_wgmma_kernel<<<unsigned(tokens), kThreads, kBwdSmemBytes, stream_of(ctx)>>>(
        dev(q), dev(kv), idx, len, kslots, tokens, scale, dev(out), lse, dev(dout), dev(dq), dkv);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
