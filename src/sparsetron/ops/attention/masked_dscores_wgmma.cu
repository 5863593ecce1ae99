// The masked expanded attention's dS from saved probabilities with dP kept in registers (sm_90,
// v 256): dS_h = scale P_h (dO_h V_h^T - D) for one chunk of query tokens, every head. The
// unfused form writes dP = dO V^T in fp32 through memory (a cuBLASLt GEMM) and a second kernel
// reads it back with P: 4 + 4 bytes per score element of the chunk.
//
// One block per (64 query rows, head), two warpgroups, looping over the row block's key tiles of
// 128 (64 keys per warpgroup): the dO rows (64 x 256) stay in shared memory, each tile's V rows
// (128 x 256) and P rows (64 x 128) stream through two buffers by cp.async (the next tile's copies
// in flight during this tile's MMAs and epilogue), the operands in 128-byte-swizzled [64 rows][64]
// slices (sparse_mqa_wgmma.cuh's layout, both K-major). dP = dO V^T is 16 m64n64k16 MMAs per
// warpgroup and tile; the epilogue turns the shared P tile into dS in place at the accumulator's
// positions, and the block writes it out in 16-byte pieces of whole rows. Key tiles
// wholly past the row block's last query token are causally empty: P = 0 there, so their dS = 0 is
// written without loads or products. The sum is the GEMM's (fp32 accumulation over the 256 dims),
// so only the summation order differs from the unfused form. (One block per 128-key tile without
// pipelining measured no faster than the unfused pair, and reading P from global memory in the
// epilogue left each tile waiting for its P loads: docs/perf/log/.)
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/attention/masked_rows.cuh"
#include "sparsetron/ops/attention/sparse_mqa_wgmma.cuh"
#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda {

namespace {

using namespace flash_mqa;

constexpr int kVDim = 256, kDvSlices = kVDim / 64;
constexpr int kRows = 64, kKeys = 128;                  // the block's query rows, keys per tile
constexpr int kOperandBytes = kDvSlices * kSliceBytes;  // 64 rows x 256 (32 KiB)
constexpr int kVBytes = 2 * kOperandBytes;              // a tile's 128 V rows
static_assert(kKeys == 2 * 64 && kThreads == 256, "two warpgroups of 64 keys each");
// A tile's P (then dS) rows: 128 keys, padded to 272 bytes so the accumulator-ordered 4-byte
// accesses of a warp (8 rows x 4 quads) hit 32 banks.
constexpr int kPLd = kKeys * 2 + 16, kPBytes = kRows * kPLd;
// Alignment slack, dO, two V buffers, two P buffers: one block per SM.
constexpr size_t kSmemBytes = 1024 + kOperandBytes + 2 * size_t(kVBytes) + 2 * size_t(kPBytes);
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");

#ifdef ST_WGMMA
// Tile kt's V rows (keys k0 .. k0 + 127 of head h; zeros at or past t1) into `buf`: two 64-row
// operands, one per warpgroup; and its P rows (chunk rows q0 .., zeros past n or lds) into
// `pbuf`, 16 pieces of 16 bytes per row.
__device__ __forceinline__ void load_tile(uint32_t buf, uint32_t pbuf, const bf* v, int64_t v_row,
                                          int64_t v_head, const bf* p, int64_t lds, int64_t h,
                                          int64_t heads, int64_t q0, int64_t n, int64_t k0,
                                          int64_t t1) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int64_t ka = k0 + 64 * s + (threadIdx.x >> 3), kb = ka + 32;
        const bf* rows[2] = {v + min(ka, t1 - 1) * v_row + h * v_head,
                             v + min(kb, t1 - 1) * v_row + h * v_head};
        const bool valid[2] = {ka < t1, kb < t1};
        load_rows<kDvSlices>(buf + uint32_t(s * kOperandBytes), rows, valid);
    }
    const int piece = threadIdx.x & 15;
    const int64_t key = k0 + 8 * piece;
#pragma unroll
    for (int it = 0; it < kRows / 16; ++it) {
        const int r = (threadIdx.x >> 4) + 16 * it;
        const int64_t q = q0 + r;
        const bool ok = q < n && key < lds;
        wgmma::cp_async16(pbuf + uint32_t(r * kPLd + piece * 16),
                          ok ? p + (q * heads + h) * lds + key : p, ok);
    }
}
#endif

__global__ void __launch_bounds__(kThreads, 1)
    masked_dscores_wgmma_kernel(const bf* dout, const bf* v, int64_t v_row, int64_t v_head,
                                const bf* p, bf* ds, int64_t lds, const float* dsum, int64_t t0,
                                int64_t n, int64_t t1, int64_t heads, float scale) {
#ifdef ST_WGMMA
    extern __shared__ unsigned char smem_raw[];
    const SmemBase sb = aligned_smem_base(smem_raw);
    const uint32_t base = sb.addr;
    unsigned char* const gbase = sb.ptr;
    const uint32_t do_tile = base, p0 = base + uint32_t(kOperandBytes + 2 * kVBytes);
    auto v_buf = [&](int64_t kt) { return base + uint32_t(kOperandBytes + (kt & 1) * kVBytes); };
    auto p_buf = [&](int64_t kt) { return p0 + uint32_t((kt & 1) * kPBytes); };
    auto p_ptr = [&](int64_t kt) { return gbase + (p_buf(kt) - base); };
    const int64_t h = blockIdx.y, q0 = int64_t(blockIdx.x) * kRows;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int quad = lane & 3, r0 = warp * 16 + lane / 4;  // this thread's rows: r0, r0 + 8
    // Key tiles up to the row block's last query token are live; past it (up to lds) P = 0.
    const int64_t live = (t0 + min(n, q0 + kRows) - 1) / kKeys + 1;
    {
        const int64_t a = q0 + (tid >> 3), b = a + 32;  // the chunk rows this thread copies
        const bf* rows[2] = {dout + ((t0 + min(a, n - 1)) * heads + h) * kVDim,
                             dout + ((t0 + min(b, n - 1)) * heads + h) * kVDim};
        const bool valid[2] = {a < n, b < n};
        load_rows<kDvSlices>(do_tile, rows, valid);
    }
    load_tile(v_buf(0), p_buf(0), v, v_row, v_head, p, lds, h, heads, q0, n, 0, t1);
    cp_async_commit();
    float d[2];  // D of this thread's rows
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int64_t q = q0 + r0 + 8 * half;
        d[half] = q < n ? dsum[(t0 + q) * heads + h] : 0.f;
    }
    const uint64_t da = k_major(do_tile);
    for (int64_t kt = 0; kt < live; ++kt) {
        if (kt + 1 < live)
            load_tile(v_buf(kt + 1), p_buf(kt + 1), v, v_row, v_head, p, lds, h, heads, q0, n,
                      (kt + 1) * kKeys, t1);
        cp_async_commit();                            // possibly empty
        asm volatile("cp.async.wait_group 1;\n" ::);  // dO and tile kt have landed
        fence_async_proxy();
        __syncthreads();
        float acc[32];
        const uint64_t db = k_major(v_buf(kt) + uint32_t(wg * kOperandBytes));
        chunk_dots<kDvSlices>(acc, da, db);
        mma_commit();
        mma_wait();
        // acc[4 j + 2 half + e]: row r0 + 8 half, key 64 wg + 8 j + 2 quad + e of the tile; dS
        // over P in place (each word read and written by this thread only).
        unsigned char* pt = p_ptr(kt);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                auto* w = reinterpret_cast<__nv_bfloat162*>(pt + (r0 + 8 * half) * kPLd +
                                                            (64 * wg + 8 * j + 2 * quad) * 2);
                const float2 pf = __bfloat1622float2(*w);
                float2 e;
                e.x = pf.x != 0.f ? scale * pf.x * (acc[4 * j + 2 * half] - d[half]) : 0.f;
                e.y = pf.y != 0.f ? scale * pf.y * (acc[4 * j + 2 * half + 1] - d[half]) : 0.f;
                *w = __float22bfloat162_rn(e);
            }
        __syncthreads();
        // The tile's dS rows out in 16-byte pieces (256 contiguous bytes per row).
        masked_rows::write_tile<kRows, kKeys, kPLd, kThreads>(ds, pt, q0, n, heads, h, lds,
                                                              kt * kKeys, tid);
        __syncthreads();  // buffers kt read (MMAs, dS) before tile kt + 2 lands there
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // The causally empty keys from live * kKeys to lds: zeros.
    masked_rows::zero_tails<kRows, kThreads>(ds, q0, n, heads, h, lds, live * kKeys, tid);
#else
    __trap();  // dispatched only on sm_90 (masked_dscores_wgmma_supported)
#endif
}

}  // namespace

bool masked_dscores_wgmma_supported(int64_t dv, const HeadKV& kv) {
    return has_sm90a() && dv == kVDim && kv.v_row % 8 == 0 && kv.v_head % 8 == 0 &&
           reinterpret_cast<uintptr_t>(kv.v) % 16 == 0;
}

void masked_dscores_wgmma(const ExecContext& ctx, const bf16* dout, const HeadKV& kv, const bf16* p,
                          bf16* ds, int64_t lds, const float* dsum, int64_t t0, int64_t n,
                          int64_t t1, int64_t heads, float scale) {
    ST_CHECK(masked_dscores_wgmma_supported(kVDim, kv), "masked_dscores_wgmma: unsupported shape");
    ST_CHECK(lds % 16 == 0 && lds >= t1, "masked_dscores_wgmma: leading dimension ", lds);
    if (n == 0) return;
    ST_CHECK(heads <= 65535, "masked_dscores_wgmma: ", heads, " heads in one launch");
    allow_dynamic_smem<masked_dscores_wgmma_kernel>(kSmemBytes);
    const dim3 grid(blocks_for(n, kRows), unsigned(heads));
    masked_dscores_wgmma_kernel<<<grid, kThreads, kSmemBytes, stream_of(ctx)>>>(
        dev(dout), dev(kv.v), kv.v_row, kv.v_head, dev(p), dev(ds), lds, dsum, t0, n, t1, heads,
        scale);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
