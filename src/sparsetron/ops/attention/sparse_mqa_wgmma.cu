// Sparse MQA forward on wgmma (sm_90), flash-style: the GLM-5 shape only (64 heads, qk 576 =
// latent 512 + rope 64, v 512 = the latent part of the same key rows). One block per query token:
// its 64 heads are the MMA's M; the token's selected keys go through in chunks of 64, gathered
// by cp.async into a double-buffered tile; per chunk S = Q K^T, an online softmax, O += P V.
// Scores never leave the SM and the output needs no second pass.
//
// Why: the gathered WMMA kernels (sparse_mqa_tc.cu) keep their accumulators in shared memory and
// run two passes; the masked-dense form writes fp32 scores through HBM (docs/cuda.md).
//
// Layout (wgmma.cuh's 128-byte swizzle): Q and each key chunk are 9 slices of [64 rows][64]
// (8 KiB each). A key chunk is the B operand of S = Q K^T (K-major: rows are keys) and, read
// again as MN-major atoms (a slice's 64 key rows are the reduction, its 64 dims the N), the B
// operand of O = P V: slices 0-3 for consumer warpgroup 0's output dims 0-255, 4-7 for
// warpgroup 1's 256-511. So V is never copied. P (bf16, [64 heads][64 keys]) is written by the
// softmax into one slice, the A operand of P V.
//
// Per chunk (both warpgroups, 256 threads): S for 32 of the chunk's keys each (m64n32), issued
// before the next chunk's copies so they overlap, keys past the row's count masked; row maxima
// exchanged through shared memory, so both keep the same running max m (raised only when a chunk
// exceeds it by 2^8: the O rescale is then rare); p = 2^(s log2e scale - m); each keeps its own
// running row sum (added at the end); O (m64n256 per warpgroup, in registers) rescaled when m
// moved; O += P V. The output leaves through shared memory in 16-byte stores. lse and the
// empty-row convention (len 0: out 0, lse 0) as sparse_mqa_tc.cu. With prob_sum (the indexer
// loss's teacher, Σ_h P per selected key) a second pass over the chunks recomputes S against the
// final lse and sums each key's column over the heads.
// Its speed at 4K and 32K: docs/perf/README.md.
#include <cmath>

#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/attention/sparse_mqa_wgmma.cuh"
#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda {

namespace {

using namespace flash_mqa;
// Alignment slack, Q, two key chunks, P, the row maxima and sums the warpgroups exchange.
constexpr size_t kSmemBytes = 1024 + 3 * size_t(kTileBytes) + kSliceBytes + 2 * 2 * kH * 4;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");

#ifdef ST_WGMMA
// Issues (does not wait for) one chunk's scores for this warpgroup's 32 keys: S = Q K^T over the
// 9 slices, dq / dk the descriptors of Q and of the warpgroup's first key row.
__device__ __forceinline__ void issue_scores(float (&s)[16], uint64_t dq, uint64_t dk) {
    chunk_dots<kSlices>(s, dq, dk);
    mma_commit();
}

// Scores to the log2 domain (scale_log2 = scale x log2 e), keys at or past the row's count
// (key0 + j >= n, only in the last chunk) -inf.
__device__ __forceinline__ void scale_and_mask(float (&s)[16], float scale_log2, int wg, int quad,
                                               int64_t key0, int64_t n) {
    const bool partial = key0 + kChunk > n;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& v = s[4 * i + 2 * half + e];
                v *= scale_log2;
                if (partial && key0 + 32 * wg + 8 * i + 2 * quad + e >= n) v = -INFINITY;
            }
}
#endif

// The running maximum is raised only when a chunk's exceeds it by more than this (log2 units):
// below that, p = 2^(s - m) stays under 256 (exact enough in fp32 sums and bf16 P), and the
// accumulator's rescale (128 multiplies per thread) is skipped. lse is exact either way.
[[maybe_unused]] constexpr float kStaleMaxLog2 = 8.f;
[[maybe_unused]] constexpr float kLn2 = 0.69314718f, kLog2e = 1.44269504f;

__global__ void __launch_bounds__(kThreads, 1)
    sparse_mqa_fwd_wgmma_kernel(const bf* q, const bf* kv, const int32_t* idx, const int32_t* len,
                                int64_t kslots, int64_t tokens, float scale, bf* out, float* lse,
                                float* prob_sum) {
#ifdef ST_WGMMA
    using namespace wgmma;
    extern __shared__ unsigned char smem_raw[];
    const auto [base_, gbase] = aligned_smem_base(smem_raw);
    const uint32_t base = base_;  // a plain variable: the lambda below captures it (CUDA C++17)
    const uint32_t q_tile = base, p_tile = base + 3 * kTileBytes;
    auto k_tile = [&](int64_t c) { return base + uint32_t((1 + (c & 1)) * kTileBytes); };
    float* red_max = reinterpret_cast<float*>(gbase + 3 * kTileBytes + kSliceBytes);  // [2][64]
    float* red_sum = red_max + 2 * kH;                                                // [2][64]

    const int64_t t = blockIdx.x, n = len[t];
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int quad = lane & 3, r0 = warp * 16 + lane / 4;  // this thread's rows: r0, r0 + 8
    if (n == 0) {  // no selected key: out 0, lse 0, no probability
        for (int i = tid; i < kH * kDv; i += kThreads)
            out[t * kH * kDv + i] = __float2bfloat16(0.f);
        if (tid < kH) lse[int64_t(tid) * tokens + t] = 0.f;
        for (int64_t j = tid; prob_sum && j < kslots; j += kThreads) prob_sum[t * kslots + j] = 0.f;
        return;
    }
    const int32_t* sel = idx + t * kslots;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    const float scale_log2 = scale * kLog2e;
    auto gather = [&](int64_t c, const int32_t(&key)[2]) { gather_chunk(k_tile(c), kv, key); };
    // Chunk 0 (with Q) in flight, chunk 1's keys in `keys`. In the loop, chunk c + 1's copies are
    // issued while chunk c's score MMAs run.
    int32_t keys[2];
    auto start_gathers = [&] {
        chunk_keys(sel, n, 0, keys);
        gather(0, keys);
        cp_async_commit();
        chunk_keys(sel, n, 1, keys);
    };
    auto gather_next = [&](int64_t c) {
        if (c + 1 < chunks) {
            gather(c + 1, keys);
            chunk_keys(sel, n, c + 2, keys);
        }
        cp_async_commit();  // possibly empty
    };
    {
        const bf* qrows[2] = {q + (t * kH + (tid >> 3)) * kD, q + (t * kH + (tid >> 3) + 32) * kD};
        const bool all[2] = {true, true};
        load_rows<kSlices>(q_tile, qrows, all);
    }
    start_gathers();
    const uint64_t dq = k_major(q_tile), dp = k_major(p_tile);
    auto dk = [&](int64_t c) { return k_major(k_tile(c) + wg * 32 * 128); };

    // Chunk c's scores for this warpgroup's 32 keys (log2 domain, masked), chunk c + 1's copies
    // issued while the MMAs run. Both passes over the chunks start this way.
    auto chunk_scores = [&](int64_t c, float(&s)[16]) {
        copies_landed();  // chunk c, and every MMA reading chunk c + 1's buffer is done
        issue_scores(s, dq, dk(c));
        gather_next(c);
        mma_wait();
        scale_and_mask(s, scale_log2, wg, quad, c * kChunk, n);
    };

    float o[kDv / 4];  // m64n256: this warpgroup's dims 256 wg .. 256 wg + 255
#pragma unroll
    for (int i = 0; i < kDv / 4; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_part[2] = {0.f, 0.f};  // log2 domain

    for (int64_t c = 0; c < chunks; ++c) {
        float s[16];
        chunk_scores(c, s);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                mx[half] = fmaxf(mx[half], fmaxf(s[4 * i + 2 * half], s[4 * i + 2 * half + 1]));
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
            mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
            if (quad == 0) red_max[wg * kH + r0 + 8 * half] = mx[half];
        }
        __syncthreads();
        float alpha[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // Key c * 64 is valid, so warpgroup 0's half has a finite maximum. Every thread of a
            // row sees the same values, so both warpgroups keep the same m_run.
            const float m_chunk = fmaxf(mx[half], red_max[(1 - wg) * kH + r0 + 8 * half]);
            alpha[half] = 1.f;
            if (m_chunk > m_run[half] + kStaleMaxLog2) {  // always on the first chunk
                alpha[half] = exp2f(m_run[half] - m_chunk);
                m_run[half] = m_chunk;
            }
        }
        float rowsum[2] = {0.f, 0.f};
        unsigned char* pbase = gbase + 3 * kTileBytes;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float p0 = exp2f(s[4 * i + 2 * half] - m_run[half]);
                const float p1 = exp2f(s[4 * i + 2 * half + 1] - m_run[half]);
                rowsum[half] += p0 + p1;
                const int row = r0 + 8 * half, col = 32 * wg + 8 * i + 2 * quad;
                *reinterpret_cast<__nv_bfloat162*>(
                    pbase + row * 128 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2) =
                    __floats2bfloat162_rn(p0, p1);
            }
#pragma unroll
        for (int half = 0; half < 2; ++half)
            l_part[half] = l_part[half] * alpha[half] + rowsum[half];
        if (c > 0 && __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < kDv / 16; ++i) {
                o[4 * i] *= alpha[0], o[4 * i + 1] *= alpha[0];
                o[4 * i + 2] *= alpha[1], o[4 * i + 3] *= alpha[1];
            }
        }
        fence_async_proxy();  // P
        __syncthreads();
        // O += P V: P [64 heads][64 keys] K-major; V = the chunk's slices 4 wg .. 4 wg + 3 read
        // MN-major (key rows are the reduction).
        mma_fence();
        const uint64_t dv = mn_major(k_tile(c) + 4 * wg * kSliceBytes);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            mma_m64k16<0, 1>(o, desc_plus(dp, kk * 32), desc_plus(dv, kk * 2048));
        mma_commit();
        mma_wait();  // the next copies_landed barrier frees P and this chunk's buffer
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // Row sums: the quad's lanes, then the other warpgroup's keys.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        l_part[half] += __shfl_xor_sync(0xffffffffu, l_part[half], 1);
        l_part[half] += __shfl_xor_sync(0xffffffffu, l_part[half], 2);
        if (quad == 0) red_sum[wg * kH + r0 + 8 * half] = l_part[half];
    }
    __syncthreads();  // also: every MMA done, so the key buffers can stage the output
    float inv[2], lse_log2[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = r0 + 8 * half;
        const float l = l_part[half] + red_sum[(1 - wg) * kH + row];
        inv[half] = 1.f / l;
        lse_log2[half] = m_run[half] + log2f(l);
        if (wg == 0 && quad == 0) lse[int64_t(row) * tokens + t] = lse_log2[half] * kLn2;
    }
    // The output through shared memory (rows padded to 1040 bytes: a warp's 4-byte writes hit 32
    // banks), then 16-byte coalesced stores.
    constexpr int kStageLd = kDv * 2 + 16;
    unsigned char* stage = gbase + kTileBytes;
#pragma unroll
    for (int i = 0; i < kDv / 16; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = r0 + 8 * half, col = 256 * wg + 8 * i + 2 * quad;
            *reinterpret_cast<__nv_bfloat162*>(stage + row * kStageLd + col * 2) =
                __floats2bfloat162_rn(o[4 * i + 2 * half] * inv[half],
                                      o[4 * i + 2 * half + 1] * inv[half]);
        }
    __syncthreads();
    uint4* orow = reinterpret_cast<uint4*>(out + t * kH * kDv);
    constexpr int kPiecesPerRow = kDv * 2 / 16;
    for (int p = tid; p < kH * kPiecesPerRow; p += kThreads)
        orow[p] = *reinterpret_cast<const uint4*>(stage + (p / kPiecesPerRow) * kStageLd +
                                                  (p % kPiecesPerRow) * 16);
    if (!prob_sum) return;

    // The indexer loss's teacher needs the final lse: a second pass over the chunks (S only),
    // prob_sum[t, j] = Σ_h 2^(s[h, j] - lse_h); 0 past the row's count.
    float* colsum = red_max;  // [4 warps][64 keys]: each warp's 16 heads summed
    float* ps_row = prob_sum + t * kslots;
    __syncthreads();  // the staged output read, and red_sum read, before the buffers are reused
    start_gathers();
    for (int64_t c = 0; c < chunks; ++c) {
        float s[16];
        chunk_scores(c, s);
        // cs[2 i + e]: key 32 wg + 8 i + 2 quad + e summed over this thread's two heads, then over
        // the warp's 8 lanes of the same quad (its 16 heads).
        float cs[8];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                cs[2 * i + e] =
                    exp2f(s[4 * i + e] - lse_log2[0]) + exp2f(s[4 * i + 2 + e] - lse_log2[1]);
#pragma unroll
        for (int k = 0; k < 8; ++k)
#pragma unroll
            for (int m = 4; m < 32; m *= 2) cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], m);
        if (lane < 4)
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    colsum[warp * kH + 32 * wg + 8 * i + 2 * quad + e] = cs[2 * i + e];
        __syncthreads();
        if (tid < kChunk) {
            const int64_t j = c * kChunk + tid;
            if (j < kslots)
                ps_row[j] = j < n ? colsum[tid] + colsum[kH + tid] + colsum[2 * kH + tid] +
                                        colsum[3 * kH + tid]
                                  : 0.f;
        }
        // The next copies_landed barrier: colsum read before it is written again.
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    for (int64_t j = chunks * kChunk + tid; j < kslots; j += kThreads) ps_row[j] = 0.f;
#else
    __trap();  // dispatched only on sm_90 (sparse_mqa_forward_wgmma_supported)
#endif
}

}  // namespace

bool sparse_mqa_forward_wgmma_supported(int64_t heads, int64_t dqk, int64_t dv) {
    return has_sm90a() && flash_shape(heads, dqk, dv);
}

void sparse_mqa_forward_wgmma(const ExecContext& ctx, const SparseMqa& p, bf16* out, float* lse,
                              float* prob_sum) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16 *q = p.q, *kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    ST_CHECK(sparse_mqa_forward_wgmma_supported(heads, dqk, dv),
             "sparse_mqa_forward_wgmma: ", heads, " heads, qk ", dqk, ", v ", dv,
             " (needs sm_90 and the GLM-5 shape 64 / 576 / 512)");
    if (tokens == 0) return;
    allow_dynamic_smem<sparse_mqa_fwd_wgmma_kernel>(kSmemBytes);
    sparse_mqa_fwd_wgmma_kernel<<<unsigned(tokens), kThreads, kSmemBytes, stream_of(ctx)>>>(
        dev(q), dev(kv), idx, len, kslots, tokens, scale, dev(out), lse, prob_sum);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
