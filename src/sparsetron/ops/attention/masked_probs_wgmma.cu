// The masked expanded attention's probabilities without the fp32 score round trip (sm_90,
// qk 256): for one chunk of query tokens and every head, P_h = mask(exp(scale Q_h K_h^T - lse))
// in bf16 (the chunk's layout, what the P V GEMM and the backward read) and the lse, with the
// scores kept in registers. The unfused form writes S in fp32 through memory (a write-bound
// cuBLASLt GEMM) and a probability kernel reads it back: 4 + 4 bytes per score element.
//
// One block of one warpgroup per (64 query rows of the chunk, head), 64-key tiles, two passes
// over the row block's key tiles: the first keeps an online max / sum per row (log2 domain) and
// ends with the lse; the second recomputes the same scores and writes P, staged in shared memory
// and stored as 16-byte pieces of whole rows. Q's rows stay in shared memory; each step's K rows
// (64 x 256) and the rows' selected-key bits (64 x 64 bits, from build_token_key_masks) come by
// cp.async into two buffers, the next step's in flight during this one. Two blocks share an SM
// (107 KiB of shared memory each), so one block's MMAs run under the other's exponentials (one
// block of two warpgroups per SM ran both in turn, the ALU its busiest pipe). Q as the MMAs'
// register operand (three blocks per SM, only K read from shared memory) measured no faster
// (docs/perf/log/). Tiles past the row block's last query token
// are causally empty: zeros. 2^x is one MUFU.EX2 and the first pass's row reductions run as four
// chains (see exp2_of). A row with no selected key gets lse 0 and P 0 (the
// other kernels' convention). The extra pass costs the scores' FLOPs again and no bytes.
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/attention/masked_rows.cuh"
#include "sparsetron/ops/attention/sparse_mqa_wgmma.cuh"
#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda {

namespace {

using namespace flash_mqa;

constexpr int kQkDim = 256, kQkSlices = kQkDim / 64;
constexpr int kRows = 64, kKeys = 64;                   // the block's query rows, keys per tile
constexpr int kBlockThreads = 128;                      // one warpgroup
constexpr int kOperandBytes = kQkSlices * kSliceBytes;  // 64 rows x 256 (32 KiB): Q, a K tile
constexpr int kMaskBytes = kRows * kKeys / 8;           // a tile's mask bits (512 B)
// The P staging tile: rows padded to 144 bytes (a warp's accumulator-ordered 4-byte writes, 8
// rows x 4 quads, hit 32 banks).
constexpr int kPLd = kKeys * 2 + 16, kPBytes = kRows * kPLd;
constexpr size_t kSmemBytes =
    1024 + kOperandBytes + 2 * size_t(kOperandBytes + kMaskBytes) + kPBytes;
static_assert(2 * (kSmemBytes + 1024) <= 228 * 1024, "two blocks per SM");
[[maybe_unused]] constexpr float kLn2 = 0.69314718f, kLog2e = 1.44269504f;

#ifdef ST_WGMMA
// 64 rows into the 64-row operand at `tile` by 128 threads: load_rows (written for 256) twice,
// rows 0-15 / 32-47, then 16-31 / 48-63 (16 rows on keeps the swizzle's row phase).
template <typename RowOf>
__device__ __forceinline__ void load_operand(uint32_t tile, RowOf row_of) {
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const int a = 16 * part + (threadIdx.x >> 3), b = a + 32;
        const bf* rows[2];
        bool valid[2];
        row_of(a, rows[0], valid[0]);
        row_of(b, rows[1], valid[1]);
        load_rows<kQkSlices>(tile + uint32_t(16 * part * 128), rows, valid);
    }
}

__device__ __forceinline__ void cp_async8(uint32_t smem, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem), "l"(gmem),
                 "r"(valid ? 8 : 0));
}

// Tile kt's K rows (keys 64 kt .. 64 kt + 63 of head h; zeros at or past t1) into `buf` and its
// mask words (rows q0 .., 2 words each; zeros past n) into `mbuf`.
__device__ __forceinline__ void load_tile(uint32_t buf, uint32_t mbuf, const bf* k, int64_t k_row,
                                          int64_t k_head, const uint32_t* mask, int64_t mwords,
                                          int64_t h, int64_t t0, int64_t q0, int64_t n, int64_t kt,
                                          int64_t t1) {
    const int64_t k0 = kt * kKeys;
    load_operand(buf, [&](int r, const bf*& row, bool& ok) {
        ok = k0 + r < t1;
        row = k + min(k0 + r, t1 - 1) * k_row + h * k_head;
    });
    if (threadIdx.x < kRows) {
        const int64_t q = q0 + threadIdx.x;
        const bool ok = q < n;
        cp_async8(mbuf + threadIdx.x * 8, ok ? mask + (t0 + q) * mwords + 2 * kt : mask, ok);
    }
}

// Masks this thread's 16 scores of row half (acc[4 j + 2 half + e], key 8 j + 2 quad + e of the
// tile) to -inf where the key is not selected: word j / 4 of the row's two, bit 8 (j % 4) +
// 2 quad + e. Most tiles are wholly selected (the rows up to the top-k select every earlier key):
// one test skips the bit work there.
__device__ __forceinline__ void mask_half(float (&acc)[32], int half, uint32_t w0, uint32_t w1,
                                          int quad) {
    if ((w0 & w1) == 0xffffffffu) return;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            if (!(((j < 4 ? w0 : w1) >> ((j & 3) * 8 + 2 * quad + e)) & 1u))
                acc[4 * j + 2 * half + e] = -INFINITY;
}

// 2^x as one MUFU.EX2 (ex2.approx.ftz; results below 2^-126 flush to 0, far below what a
// probability or a row sum of them can show); exp2f would add ptxas's denormal range fix-up.
__device__ __forceinline__ float exp2_of(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
#endif

// The first pass's row max and sum over a thread's 16 scores run as four independent chains:
// with two warps per scheduler, one dependent chain of adds and maxes stalls on its latency.
__global__ void __launch_bounds__(kBlockThreads, 2)
    masked_probs_wgmma_kernel(const bf* q, const bf* k, int64_t k_row, int64_t k_head,
                              const uint32_t* mask, int64_t mwords, bf* p, int64_t lds, float* lse,
                              int64_t tokens, int64_t t0, int64_t n, int64_t t1, int64_t heads,
                              float scale) {
#ifdef ST_WGMMA
    extern __shared__ unsigned char smem_raw[];
    const SmemBase sb = aligned_smem_base(smem_raw);
    const uint32_t base = sb.addr;
    unsigned char* const gbase = sb.ptr;
    const uint32_t q_tile = base, k_base = base + uint32_t(kOperandBytes),
                   m_base = k_base + uint32_t(2 * kOperandBytes), p_tile = m_base + 2 * kMaskBytes;
    unsigned char* const p_ptr = gbase + (p_tile - base);
    const uint32_t* const mask_ptr = reinterpret_cast<const uint32_t*>(gbase + (m_base - base));
    const int64_t h = blockIdx.y, q0 = int64_t(blockIdx.x) * kRows;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int quad = lane & 3, r0 = warp * 16 + lane / 4;  // this thread's rows: r0, r0 + 8
    // Key tiles up to the row block's last query token; past it (up to lds) P = 0.
    const int64_t live = (t0 + min(n, q0 + kRows) - 1) / kKeys + 1;
    const float scale_log2 = scale * kLog2e;
    load_operand(q_tile, [&](int r, const bf*& row, bool& ok) {
        ok = q0 + r < n;
        row = q + ((t0 + min(q0 + r, n - 1)) * heads + h) * kQkDim;
    });
    // Step s < live is the first pass over tile s, s >= live the second over tile s - live.
    auto load_step = [&](int64_t s) {
        const int64_t kt = s < live ? s : s - live;
        load_tile(k_base + uint32_t((s & 1) * kOperandBytes),
                  m_base + uint32_t((s & 1) * kMaskBytes), k, k_row, k_head, mask, mwords, h, t0,
                  q0, n, kt, t1);
    };
    load_step(0);
    cp_async_commit();
    const uint64_t da = k_major(q_tile);
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, lse2[2] = {0.f, 0.f};
    for (int64_t s = 0; s < 2 * live; ++s) {
        const bool second = s >= live;
        const int64_t kt = second ? s - live : s;
        if (s + 1 < 2 * live) load_step(s + 1);
        cp_async_commit();                            // possibly empty
        asm volatile("cp.async.wait_group 1;\n" ::);  // Q and step s have landed
        fence_async_proxy();
        __syncthreads();
        float acc[32];
        chunk_dots<kQkSlices>(acc, da, k_major(k_base + uint32_t((s & 1) * kOperandBytes)));
        mma_commit();
        mma_wait();
        const uint32_t* mrow = mask_ptr + (s & 1) * (kMaskBytes / 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = r0 + 8 * half;
            mask_half(acc, half, mrow[2 * row], mrow[2 * row + 1], quad);
        }
        if (!second) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                // kChains independent max / sum chains over the thread's 16 scores, combined
                // at the end.
                constexpr int kChains = 4;
                float m[kChains], sums[kChains];
#pragma unroll
                for (int c = 0; c < kChains; ++c) m[c] = -INFINITY, sums[c] = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    m[j % kChains] = fmaxf(m[j % kChains],
                                           fmaxf(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]));
                const float mx = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
                if (mx == -INFINITY) continue;
                const float mm = fmaxf(m_run[half], mx * scale_log2);
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        sums[(2 * j + e) % kChains] +=
                            exp2_of(fmaf(acc[4 * j + 2 * half + e], scale_log2, -mm));
                const float sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
                // exp2(-inf) = 0
                l_run[half] = l_run[half] * exp2_of(m_run[half] - mm) + sum;
                m_run[half] = mm;
            }
            if (s + 1 == live) {  // the quad's lanes merged: every row's lse
#pragma unroll
                for (int half = 0; half < 2; ++half) {
#pragma unroll
                    for (int o = 1; o <= 2; o *= 2) {
                        const float m2 = __shfl_xor_sync(0xffffffffu, m_run[half], o);
                        const float l2 = __shfl_xor_sync(0xffffffffu, l_run[half], o);
                        const float mm = fmaxf(m_run[half], m2);
                        if (mm == -INFINITY) continue;
                        l_run[half] =
                            l_run[half] * exp2_of(m_run[half] - mm) + l2 * exp2_of(m2 - mm);
                        m_run[half] = mm;
                    }
                    const bool empty = l_run[half] == 0.f;
                    lse2[half] = empty ? 0.f : m_run[half] + log2f(l_run[half]);
                    const int64_t qq = q0 + r0 + 8 * half;
                    if (quad == 0 && qq < n) lse[h * tokens + t0 + qq] = lse2[half] * kLn2;
                }
            }
        } else {
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    // Unselected keys hold -inf: exp2 gives 0.
                    const float2 e2 = make_float2(
                        exp2_of(fmaf(acc[4 * j + 2 * half], scale_log2, -lse2[half])),
                        exp2_of(fmaf(acc[4 * j + 2 * half + 1], scale_log2, -lse2[half])));
                    *reinterpret_cast<__nv_bfloat162*>(p_ptr + (r0 + 8 * half) * kPLd +
                                                       (8 * j + 2 * quad) * 2) =
                        __float22bfloat162_rn(e2);
                }
            __syncthreads();
            // The tile's P rows out in 16-byte pieces (128 contiguous bytes per row).
            masked_rows::write_tile<kRows, kKeys, kPLd, kBlockThreads>(p, p_ptr, q0, n, heads, h,
                                                                       lds, kt * kKeys, tid);
        }
        __syncthreads();  // step s's buffers read (MMAs, mask, P tile) before step s + 2 lands
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // The causally empty keys from live * kKeys to lds: zeros.
    masked_rows::zero_tails<kRows, kBlockThreads>(p, q0, n, heads, h, lds, live * kKeys, tid);
#else
    __trap();  // dispatched only on sm_90 (masked_probs_wgmma_supported)
#endif
}

}  // namespace

bool masked_probs_wgmma_supported(int64_t dqk, const HeadKV& kv) {
    return has_sm90a() && dqk == kQkDim && kv.k_row % 8 == 0 && kv.k_head % 8 == 0 &&
           reinterpret_cast<uintptr_t>(kv.k) % 16 == 0;
}

int64_t token_key_mask_words(int64_t tokens) {
    return ((tokens + 31) / 32 + 3) / 4 * 4;  // whole 16-byte pieces per row
}

void masked_probs_wgmma(const ExecContext& ctx, const bf16* q, const HeadKV& kv,
                        const uint32_t* mask, int64_t mwords, bf16* p, int64_t lds, float* lse,
                        int64_t tokens, int64_t t0, int64_t n, int64_t t1, int64_t heads,
                        float scale) {
    ST_CHECK(masked_probs_wgmma_supported(kQkDim, kv), "masked_probs_wgmma: unsupported shape");
    ST_CHECK(lds % 16 == 0 && lds >= t1, "masked_probs_wgmma: leading dimension ", lds);
    ST_CHECK(mwords % 4 == 0 && mwords * 32 >= (t1 + kKeys - 1) / kKeys * kKeys,
             "masked_probs_wgmma: ", mwords, " mask words per token");
    ST_CHECK(reinterpret_cast<uintptr_t>(q) % 16 == 0, "masked_probs_wgmma: unaligned queries");
    if (n == 0) return;
    ST_CHECK(heads <= 65535, "masked_probs_wgmma: ", heads, " heads in one launch");
    auto* kernel = masked_probs_wgmma_kernel;
    static const bool carved = [&] {  // the whole unified L1 as shared memory: two blocks per SM
        ST_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(kSmemBytes)));
        ST_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           int(cudaSharedmemCarveoutMaxShared)));
        return true;
    }();
    (void)carved;
    const dim3 grid(blocks_for(n, kRows), unsigned(heads));
    kernel<<<grid, kBlockThreads, kSmemBytes, stream_of(ctx)>>>(
        dev(q), dev(kv.k), kv.k_row, kv.k_head, mask, mwords, dev(p), lds, lse, tokens, t0, n, t1,
        heads, scale);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
