// The DSA top-k with the row in registers (topk_rows_registers; rows of at most 32768 keys): the
// engine's form until the streaming kernel (topk_stream.cu) replaced it, kept so the harness
// measures the two against each other and the tests hold both to the CPU rule.
//
// One block of 1024 threads per row holds the row (read once, coalesced) and selects the
// threshold in 3 passes of 11 / 11 / 10 bits (topk_threshold, topk_row.cuh), then places the kept
// keys with ballots and block scans. Measured on one H200
// (docs/perf/2026-11-30-indexer-scores-wgmma.md): 4.5-4.7 ms at 32K keys, 107 us at 4K, against the
// streaming kernel's 2.8 ms / 73 us; ncu found it latency-bound (one row per SM at half occupancy)
// and spilling at 32 keys per thread.
#include <cub/block/block_scan.cuh>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"
#include "sparsetron/ops/cuda/topk_row.cuh"

namespace sparsetron::cuda {
namespace {

constexpr int kRegTopkThreads = 1024;

// Thread i holds keys i + 1024 m, m < kPer (coalesced loads), rows of
// at most kPer x 1024 keys, the threshold by topk_threshold (topk_row.cuh). Placement in key
// order: per (m, warp) a ballot counts the warp's kept keys, one block scan over the kPer x 32
// counts (m-major: key order) gives each its base, the lanes below a key in its ballot its offset.
// When every key equal to the threshold is kept (no tie straddles the k-th place: the usual case),
// kept = above or equal and the tie ranks are skipped.
template <int kPer>
__global__ void __launch_bounds__(kRegTopkThreads, 1)
    topk_regs_kernel(const float* scores, int64_t ld, const int32_t* row_begin,
                     const int32_t* key_row, int64_t kslots, int32_t* idx, int32_t* len) {
    static_assert(kPer * 32 <= kRegTopkThreads && kPer <= 32, "one scan entry per (m, warp)");
    using Scan = cub::BlockScan<int, kRegTopkThreads>;
    __shared__ TopkSelectShared<kRegTopkThreads> sm;
    const int64_t t = blockIdx.x;
    const TopkRow r = topk_row(scores, ld, row_begin, key_row, kslots, idx, t);
    if (topk_short_row(r, kslots, len, t)) return;
    const auto [begin, n, row, out] = r;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t below = (1u << lane) - 1u;  // lanes before this one in a ballot
    // This thread's keys: m < held (n <= kPer x 1024, so held <= kPer).
    const int held = n > tid ? int((n - tid + kRegTopkThreads - 1) / kRegTopkThreads) : 0;
    uint32_t u[kPer];
    const float* mine = row + tid;
#pragma unroll
    for (int m = 0; m < kPer; ++m) u[m] = m < held ? order_key(mine[m * kRegTopkThreads]) : 0u;
    const TopkThreshold th = topk_threshold(sm, kslots, [&](auto f) {
#pragma unroll
        for (int m = 0; m < kPer; ++m)
            if (m < held) f(u[m]);
    });
    const uint32_t thr = th.thr;
    const int need = th.need;  // how many keys equal to thr are kept (the smallest indices)
    int* hist = sm.hist;       // reused for the placement's per-(m, warp) bases
    // Key-order bases of each (m, warp)'s flagged keys, in hist[m * 32 + warp].
    auto bases = [&](auto flag) {
#pragma unroll
        for (int m = 0; m < kPer; ++m) {
            const uint32_t b = __ballot_sync(0xffffffffu, flag(m));
            if (lane == 0) hist[m * 32 + warp] = __popc(b);
        }
        __syncthreads();
        const int c = tid < kPer * 32 ? hist[tid] : 0;
        int base;
        Scan(sm.scan).ExclusiveSum(c, base);
        if (tid < kPer * 32) hist[tid] = base;
        __syncthreads();
    };
    uint32_t keep = 0;  // bit m: key i + 1024 m is kept
    if (need == th.equal) {
        // Every key equal to the threshold is kept.
#pragma unroll
        for (int m = 0; m < kPer; ++m)
            if (m < held && u[m] >= thr) keep |= 1u << m;
    } else {
        auto is_eq = [&](int m) { return m < held && u[m] == thr; };
        bases(is_eq);
#pragma unroll
        for (int m = 0; m < kPer; ++m) {
            const uint32_t b = __ballot_sync(0xffffffffu, is_eq(m));
            const int rank = hist[m * 32 + warp] + __popc(b & below);
            if (m < held && (u[m] > thr || (u[m] == thr && rank < need))) keep |= 1u << m;
        }
        __syncthreads();  // every rank read before the second scan overwrites hist
    }
    auto kept = [&](int m) { return (keep >> m) & 1u; };
    bases(kept);
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
        const uint32_t b = __ballot_sync(0xffffffffu, kept(m));
        if (kept(m))
            out[hist[m * 32 + warp] + __popc(b & below)] =
                int32_t(begin + int64_t(m) * kRegTopkThreads + tid);
    }
    if (tid == 0) len[t] = int32_t(kslots);
}

}  // namespace

void topk_rows_registers(const ExecContext& ctx, const float* scores, int64_t ld,
                         const int32_t* row_begin, int64_t tokens, int64_t kslots, int32_t* idx,
                         int32_t* len, const int32_t* key_row) {
    if (tokens == 0) return;
    // Rows are at most ld keys: the smallest run of keys per thread that holds them.
    const int64_t per = (ld + kRegTopkThreads - 1) / kRegTopkThreads;
    ST_CHECK(per <= 32, "topk_rows_registers: rows of up to ", ld, " keys exceed 32 x ",
             kRegTopkThreads);
    auto regs = [&](auto kernel) {
        kernel<<<tokens, kRegTopkThreads, 0, stream_of(ctx)>>>(scores, ld, row_begin, key_row,
                                                               kslots, idx, len);
    };
    if (per <= 4)
        regs(topk_regs_kernel<4>);
    else if (per <= 8)
        regs(topk_regs_kernel<8>);
    else if (per <= 16)
        regs(topk_regs_kernel<16>);
    else
        regs(topk_regs_kernel<32>);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
