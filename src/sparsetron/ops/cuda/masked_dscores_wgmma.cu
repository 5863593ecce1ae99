// The masked expanded attention's dS from saved probabilities with dP kept in registers (sm_90,
// v 256): dS_h = scale P_h (dO_h V_h^T - D) for one chunk of query tokens, every head. The
// unfused form writes dP = dO V^T in fp32 through memory (a cuBLASLt GEMM) and a second kernel
// reads it back with P: 4 + 4 bytes per score element of the chunk (~4.8 GB per proxy layer at
// 4K), ~1.24 ms per layer in masked_dscores_saved_kernel alone (ncu, 0388bdf).
//
// One block per (128 keys, 64 query rows, head), two warpgroups of 64 keys each: the block's dO
// rows (64 x 256) and V rows (128 x 256) go into 128-byte-swizzled [64 rows][64] slices
// (sparse_mqa_wgmma.cuh's layout, both K-major), dP = dO V^T is 16 m64n64k16 MMAs per warpgroup,
// and the epilogue reads P at the accumulator's positions and writes dS. Tiles wholly past the
// last query token of the block are causally empty: P = 0 there, so dS = 0 is written without
// loading or multiplying. The sum is the GEMM's (fp32 accumulation over the 256 dims), so only
// the summation order differs from the unfused form.
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/sparse_mqa_wgmma.cuh"

namespace sparsetron::cuda {

namespace {

using namespace flash_mqa;

constexpr int kVDim = 256, kDvSlices = kVDim / 64;
constexpr int kRows = 64, kKeys = 128;                  // the block's query rows and keys
constexpr int kOperandBytes = kDvSlices * kSliceBytes;  // 64 rows x 256 (32 KiB)
// Alignment slack, dO, and V as two 64-key operands (one per warpgroup): two blocks per SM.
constexpr size_t kSmemBytes = 1024 + 3 * size_t(kOperandBytes);

__global__ void __launch_bounds__(kThreads, 2)
    masked_dscores_wgmma_kernel(const bf* dout, const bf* v, int64_t v_row, int64_t v_head,
                                const bf* p, bf* ds, int64_t lds, const float* dsum, int64_t t0,
                                int64_t n, int64_t t1, int64_t heads, float scale) {
#ifdef ST_WGMMA
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = aligned_smem_base(smem_raw).addr;
    const int64_t h = blockIdx.z, q0 = int64_t(blockIdx.y) * kRows,
                  k0 = int64_t(blockIdx.x) * kKeys;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int quad = lane & 3, r0 = warp * 16 + lane / 4;  // this thread's rows: r0, r0 + 8
    // Keys past the block's last query token are causally unselected.
    const bool live = k0 <= t0 + min(n, q0 + kRows) - 1;
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    if (live) {
        const int64_t a = q0 + (tid >> 3), b = a + 32;  // the chunk rows this thread copies
        {
            const bf* rows[2] = {dout + ((t0 + min(a, n - 1)) * heads + h) * kVDim,
                                 dout + ((t0 + min(b, n - 1)) * heads + h) * kVDim};
            const bool valid[2] = {a < n, b < n};
            load_rows<kDvSlices>(base, rows, valid);
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int64_t ka = k0 + 64 * s + (tid >> 3), kb = ka + 32;
            const bf* rows[2] = {v + min(ka, t1 - 1) * v_row + h * v_head,
                                 v + min(kb, t1 - 1) * v_row + h * v_head};
            const bool valid[2] = {ka < t1, kb < t1};
            load_rows<kDvSlices>(base + uint32_t((1 + s) * kOperandBytes), rows, valid);
        }
        cp_async_commit();
        copies_landed();
        const uint64_t da = k_major(base), db = k_major(base + uint32_t((1 + wg) * kOperandBytes));
        mma_fence();
#pragma unroll
        for (int sl = 0; sl < kDvSlices; ++sl)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const uint32_t off = sl * kSliceBytes + kk * 32;
                wgmma::mma_m64k16<0, 0>(acc, desc_plus(da, off), desc_plus(db, off));
            }
        mma_commit();
        mma_wait();
    }
    // acc[4 j + 2 half + e]: row r0 + 8 half, key 64 wg + 8 j + 2 quad + e of the block.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int64_t q = q0 + r0 + 8 * half;
        if (q >= n) continue;
        const int64_t row = (q * heads + h) * lds;
        const float d = live ? dsum[(t0 + q) * heads + h] : 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int64_t key = k0 + 64 * wg + 8 * j + 2 * quad;
            if (key >= lds) continue;  // lds is a multiple of 16: a pair is all in or all out
            float2 e = make_float2(0.f, 0.f);
            if (live) {
                const float2 pv =
                    __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p + row + key));
                e.x = pv.x != 0.f ? scale * pv.x * (acc[4 * j + 2 * half] - d) : 0.f;
                e.y = pv.y != 0.f ? scale * pv.y * (acc[4 * j + 2 * half + 1] - d) : 0.f;
            }
            *reinterpret_cast<__nv_bfloat162*>(ds + row + key) = __float22bfloat162_rn(e);
        }
    }
#else
    __trap();  // dispatched only on sm_90 (masked_dscores_wgmma_supported)
#endif
}

}  // namespace

bool masked_dscores_wgmma_supported(int64_t dv, const HeadKV& kv) {
    static const bool off = env_is("SPARSETRON_MASKED_DSCORES", "unfused");  // for A/B
    return !off && grouped_gemm_wgmma_available() && dv == kVDim && kv.v_row % 8 == 0 &&
           kv.v_head % 8 == 0 && reinterpret_cast<uintptr_t>(kv.v) % 16 == 0;
}

void masked_dscores_wgmma(const ExecContext& ctx, const bf16* dout, const HeadKV& kv, const bf16* p,
                          bf16* ds, int64_t lds, const float* dsum, int64_t t0, int64_t n,
                          int64_t t1, int64_t heads, float scale) {
    ST_CHECK(masked_dscores_wgmma_supported(kVDim, kv), "masked_dscores_wgmma: unsupported shape");
    ST_CHECK(lds % 16 == 0 && lds >= t1, "masked_dscores_wgmma: leading dimension ", lds);
    if (n == 0) return;
    ST_CHECK(heads <= 65535 && blocks_for(n, kRows) <= 65535, "masked_dscores_wgmma: ", n,
             " rows x ", heads, " heads in one launch");
    allow_dynamic_smem<masked_dscores_wgmma_kernel>(kSmemBytes);
    const dim3 grid(blocks_for(lds, kKeys), blocks_for(n, kRows), unsigned(heads));
    masked_dscores_wgmma_kernel<<<grid, kThreads, kSmemBytes, stream_of(ctx)>>>(
        dev(dout), dev(kv.v), kv.v_row, kv.v_head, dev(p), dev(ds), lds, dsum, t0, n, t1, heads,
        scale);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
