// The masked expanded attention's probabilities without the fp32 score round trip (sm_90,
// qk 256): for one chunk of query tokens and every head, P_h = mask(exp(scale Q_h K_h^T - lse))
// in bf16 (the chunk's layout, what the P V GEMM and the backward read) and the lse, with the
// scores kept in registers. The unfused form writes S in fp32 through memory (a cuBLASLt GEMM,
// 0.92 ms per proxy layer at 4K, write-bound) and the probability kernel reads it back (1.67 ms
// per layer): 4 + 4 bytes per score element.
//
// One block per (64 query rows of the chunk, head), two warpgroups of 64 keys per 128-key tile,
// in two passes over the row block's key tiles: the first keeps an online max / sum per row
// (log2 domain) and ends with the lse; the second recomputes the same scores (the same MMAs in
// the same order: bit-identical) and writes P, staged in shared memory and stored as 16-byte
// pieces of whole rows. Q's rows stay in shared memory; each step's K rows (128 x 256) and the
// rows' selected-key bits (64 x 128 bits, from build_token_key_masks) come by cp.async into two
// buffers, the next step's in flight during this one. Tiles past the row block's last query
// token are causally empty: zeros. A row with no selected key gets lse 0 and P 0 (the other
// kernels' convention). The extra pass costs the scores' FLOPs again (309 GFLOP per proxy layer)
// and no bytes.
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/sparse_mqa_wgmma.cuh"

namespace sparsetron::cuda {

namespace {

using namespace flash_mqa;

constexpr int kQkDim = 256, kQkSlices = kQkDim / 64;
constexpr int kRows = 64, kKeys = 128;  // the block's query rows, keys per tile
static_assert(kKeys == 2 * 64 && kThreads == 256, "two warpgroups of 64 keys each");
constexpr int kOperandBytes = kQkSlices * kSliceBytes;  // 64 rows x 256 (32 KiB)
constexpr int kKBytes = 2 * kOperandBytes;              // a tile's 128 K rows
constexpr int kMaskBytes = kRows * kKeys / 8;           // a tile's mask bits (1 KiB)
// The P staging tile: rows padded to 272 bytes (a warp's accumulator-ordered 4-byte writes, 8
// rows x 4 quads, hit 32 banks).
constexpr int kPLd = kKeys * 2 + 16, kPBytes = kRows * kPLd;
constexpr int kRedBytes = 2 * 2 * kRows * 4;  // [2 warpgroups][m, l][64 rows]
constexpr size_t kSmemBytes =
    1024 + kOperandBytes + 2 * size_t(kKBytes + kMaskBytes) + kPBytes + kRedBytes;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
[[maybe_unused]] constexpr float kLn2 = 0.69314718f, kLog2e = 1.44269504f;

#ifdef ST_WGMMA
// Tile kt's K rows (keys k0 .. k0 + 127 of head h; zeros at or past t1) into `buf` (two 64-row
// operands, one per warpgroup) and its mask words (rows q0 .., 4 words each: one 16-byte piece
// per row, zeros past n) into `mbuf`.
__device__ __forceinline__ void load_tile(uint32_t buf, uint32_t mbuf, const bf* k, int64_t k_row,
                                          int64_t k_head, const uint32_t* mask, int64_t mwords,
                                          int64_t h, int64_t t0, int64_t q0, int64_t n, int64_t kt,
                                          int64_t t1) {
    const int64_t k0 = kt * kKeys;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int64_t ka = k0 + 64 * s + (threadIdx.x >> 3), kb = ka + 32;
        const bf* rows[2] = {k + min(ka, t1 - 1) * k_row + h * k_head,
                             k + min(kb, t1 - 1) * k_row + h * k_head};
        const bool valid[2] = {ka < t1, kb < t1};
        load_rows<kQkSlices>(buf + uint32_t(s * kOperandBytes), rows, valid);
    }
    if (threadIdx.x < kRows) {
        const int64_t q = q0 + threadIdx.x;
        const bool ok = q < n;
        wgmma::cp_async16(mbuf + threadIdx.x * 16, ok ? mask + (t0 + q) * mwords + 4 * kt : mask,
                          ok);
    }
}
#endif

__global__ void __launch_bounds__(kThreads, 1)
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
                   m_base = k_base + uint32_t(2 * kKBytes), p_tile = m_base + 2 * kMaskBytes;
    unsigned char* const p_ptr = gbase + (p_tile - base);
    const uint32_t* const mask_ptr = reinterpret_cast<const uint32_t*>(gbase + (m_base - base));
    float* const red = reinterpret_cast<float*>(p_ptr + kPBytes);  // [wg][m, l][row]
    const int64_t h = blockIdx.y, q0 = int64_t(blockIdx.x) * kRows;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int quad = lane & 3, r0 = warp * 16 + lane / 4;  // this thread's rows: r0, r0 + 8
    // Key tiles up to the row block's last query token; past it (up to lds) P = 0.
    const int64_t live = (t0 + min(n, q0 + kRows) - 1) / kKeys + 1;
    const float scale_log2 = scale * kLog2e;
    {
        const int64_t a = q0 + (tid >> 3), b = a + 32;  // the chunk rows this thread copies
        const bf* rows[2] = {q + ((t0 + min(a, n - 1)) * heads + h) * kQkDim,
                             q + ((t0 + min(b, n - 1)) * heads + h) * kQkDim};
        const bool valid[2] = {a < n, b < n};
        load_rows<kQkSlices>(q_tile, rows, valid);
    }
    // Step s < live is the first pass over tile s, s >= live the second over tile s - live.
    auto load_step = [&](int64_t s) {
        const int64_t kt = s < live ? s : s - live;
        load_tile(k_base + uint32_t((s & 1) * kKBytes), m_base + uint32_t((s & 1) * kMaskBytes), k,
                  k_row, k_head, mask, mwords, h, t0, q0, n, kt, t1);
    };
    load_step(0);
    cp_async_commit();
    const uint64_t da = k_major(q_tile);
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, lse2[2] = {0.f, 0.f};
    bool empty[2] = {true, true};
    for (int64_t s = 0; s < 2 * live; ++s) {
        const bool second = s >= live;
        const int64_t kt = second ? s - live : s;
        if (s + 1 < 2 * live) load_step(s + 1);
        cp_async_commit();                            // possibly empty
        asm volatile("cp.async.wait_group 1;\n" ::);  // Q and step s have landed
        fence_async_proxy();
        __syncthreads();
        if (s == live) {  // the first pass is over: every row's lse from both warpgroups
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = r0 + 8 * half;
                const float mo = red[((1 - wg) * 2) * kRows + row];
                const float lo = red[((1 - wg) * 2 + 1) * kRows + row];
                const float mm = fmaxf(m_run[half], mo);
                const float l =
                    (m_run[half] == -INFINITY ? 0.f : l_run[half] * exp2f(m_run[half] - mm)) +
                    (mo == -INFINITY ? 0.f : lo * exp2f(mo - mm));
                empty[half] = l == 0.f;
                lse2[half] = empty[half] ? 0.f : mm + log2f(l);
                const int64_t qq = q0 + row;
                if (wg == 0 && quad == 0 && qq < n) lse[h * tokens + t0 + qq] = lse2[half] * kLn2;
            }
        }
        float acc[32];
        const uint64_t db =
            k_major(k_base + uint32_t((s & 1) * kKBytes) + uint32_t(wg * kOperandBytes));
        chunk_dots<kQkSlices>(acc, da, db);
        mma_commit();
        mma_wait();
        // acc[4 j + 2 half + e]: row r0 + 8 half, key 64 wg + 8 j + 2 quad + e of the tile; its
        // mask bit: word 2 wg + j / 4 of the row's 4, bit 8 (j % 4) + 2 quad + e.
        const uint32_t* mrow = mask_ptr + (s & 1) * (kMaskBytes / 4);
        uint32_t bits[2][2];
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int w = 0; w < 2; ++w) bits[half][w] = mrow[(r0 + 8 * half) * 4 + 2 * wg + w];
        auto selected = [&](int half, int j, int e) {
            return (bits[half][j >> 2] >> ((j & 3) * 8 + 2 * quad + e)) & 1u;
        };
        if (!second) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float mx = -INFINITY;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (selected(half, j, e))
                            mx = fmaxf(mx, acc[4 * j + 2 * half + e] * scale_log2);
                if (mx == -INFINITY) continue;
                const float mm = fmaxf(m_run[half], mx);
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (selected(half, j, e))
                            sum += exp2f(acc[4 * j + 2 * half + e] * scale_log2 - mm);
                l_run[half] =
                    (m_run[half] == -INFINITY ? 0.f : l_run[half] * exp2f(m_run[half] - mm)) + sum;
                m_run[half] = mm;
            }
            if (s + 1 == live) {  // this warpgroup's rows: the quad's lanes merged, then shared
#pragma unroll
                for (int half = 0; half < 2; ++half) {
#pragma unroll
                    for (int o = 1; o <= 2; o *= 2) {
                        const float m2 = __shfl_xor_sync(0xffffffffu, m_run[half], o);
                        const float l2 = __shfl_xor_sync(0xffffffffu, l_run[half], o);
                        const float mm = fmaxf(m_run[half], m2);
                        l_run[half] =
                            (m_run[half] == -INFINITY ? 0.f
                                                      : l_run[half] * exp2f(m_run[half] - mm)) +
                            (m2 == -INFINITY ? 0.f : l2 * exp2f(m2 - mm));
                        m_run[half] = mm;
                    }
                    if (quad == 0) {
                        red[(wg * 2) * kRows + r0 + 8 * half] = m_run[half];
                        red[(wg * 2 + 1) * kRows + r0 + 8 * half] = l_run[half];
                    }
                }
            }
        } else {
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float2 e2;
                    e2.x = !empty[half] && selected(half, j, 0)
                               ? exp2f(acc[4 * j + 2 * half] * scale_log2 - lse2[half])
                               : 0.f;
                    e2.y = !empty[half] && selected(half, j, 1)
                               ? exp2f(acc[4 * j + 2 * half + 1] * scale_log2 - lse2[half])
                               : 0.f;
                    *reinterpret_cast<__nv_bfloat162*>(p_ptr + (r0 + 8 * half) * kPLd +
                                                       (64 * wg + 8 * j + 2 * quad) * 2) =
                        __float22bfloat162_rn(e2);
                }
            __syncthreads();
            // The tile's P rows out in 16-byte pieces (256 contiguous bytes per row).
            const int piece = tid & 15;
            const int64_t key = kt * kKeys + 8 * piece;
#pragma unroll
            for (int it = 0; it < kRows / 16; ++it) {
                const int r = (tid >> 4) + 16 * it;
                const int64_t qq = q0 + r;
                if (qq < n && key < lds)
                    *reinterpret_cast<uint4*>(p + (qq * heads + h) * lds + key) =
                        *reinterpret_cast<const uint4*>(p_ptr + r * kPLd + piece * 16);
            }
        }
        __syncthreads();  // step s's buffers read (MMAs, mask, P tile) before step s + 2 lands
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // The causally empty keys from live * kKeys to lds: zeros, 8 per 16-byte store.
    const int64_t z0 = live * kKeys, zvecs = (lds - min(lds, z0)) / 8;
    for (int64_t i = tid; i < kRows * zvecs; i += kThreads) {
        const int64_t qq = q0 + i / zvecs;
        if (qq < n)
            *reinterpret_cast<uint4*>(p + (qq * heads + h) * lds + z0 + (i % zvecs) * 8) =
                make_uint4(0u, 0u, 0u, 0u);
    }
#else
    __trap();  // dispatched only on sm_90 (masked_probs_wgmma_supported)
#endif
}

}  // namespace

bool masked_probs_wgmma_supported(int64_t dqk, const HeadKV& kv) {
    static const bool off = env_is("SPARSETRON_MASKED_SCORES", "unfused");  // for A/B
    return !off && grouped_gemm_wgmma_available() && dqk == kQkDim && kv.k_row % 8 == 0 &&
           kv.k_head % 8 == 0 && reinterpret_cast<uintptr_t>(kv.k) % 16 == 0;
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
    allow_dynamic_smem<masked_probs_wgmma_kernel>(kSmemBytes);
    const dim3 grid(blocks_for(n, kRows), unsigned(heads));
    masked_probs_wgmma_kernel<<<grid, kThreads, kSmemBytes, stream_of(ctx)>>>(
        dev(q), dev(kv.k), kv.k_row, kv.k_head, mask, mwords, dev(p), lds, lse, tokens, t0, n, t1,
        heads, scale);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
