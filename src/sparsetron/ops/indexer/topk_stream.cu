// The DSA top-k (topk_rows) with a small register footprint: an exact radix select on order_key
// images (topk_row.cuh), ties to the smaller key index, ascending output; the row is read from
// memory again for each step instead of held in registers, so several rows share an SM. (Holding
// a 32K-key row in registers leaves one row per SM at half occupancy, latency-bound and spilling:
// docs/perf/log/.) Here: 512 threads and about 40 registers, three rows per SM.
//
// Per row of n > kslots keys: (1) an 11-bit histogram of every key (the one read from HBM; the
// row stays in L2 for the next reads); (2) the threshold bin's keys copied to shared memory
// (passes 2 and 3, 11 + 10 bits, read only them; from memory again when the bin holds over 4096);
// (3) each warp owns a contiguous segment of the row and counts its kept keys (ballots), a scan
// of the 16 counts gives each warp its first output slot; (4) the warps write their kept keys in
// order. Ties straddling the k-th place add a count of equal keys per segment first. Its speed
// at 4K and 32K keys: docs/perf/README.md.
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/indexer/topk_row.cuh"

namespace sparsetron::cuda {

namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads, 3)
    topk_stream_kernel(const float* scores, int64_t ld, const int32_t* row_begin,
                       const int32_t* key_row, int64_t kslots, int32_t* idx, int32_t* len) {
    __shared__ TopkSelectShared<kThreads> sm;
    __shared__ int seg_base[kWarps];
    const int64_t t = blockIdx.x;
    const TopkRow r = topk_row(scores, ld, row_begin, key_row, kslots, idx, t);
    if (topk_short_row(r, kslots, len, t)) return;
    const int64_t n = r.n;
    const float* row = r.row;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t below = (1u << lane) - 1u;
    const TopkThreshold th = topk_threshold(sm, kslots, [&](auto f) {
        for (int64_t j = tid; j < n; j += kThreads) f(order_key(row[j]));
    });
    const uint32_t thr = th.thr;
    const int need = th.need;  // keys equal to thr that are kept (the smallest indices)
    const bool ties = need != th.equal;

    // Placement: warp w owns keys [s0, s1), walked 32 at a time (lane i: key s0 + 32 m + i).
    const int64_t seg = (n + kThreads - 1) / kThreads * 32;
    const int64_t s0 = min(n, warp * seg), s1 = min(n, s0 + seg);
    auto key_at = [&](int64_t j) { return j < s1 ? order_key(row[j]) : 0u; };
    // Segment bases (exclusive, in warp order) of a per-warp count, in seg_base.
    auto segment_bases = [&](int count) {
        if (lane == 0) seg_base[warp] = count;
        __syncthreads();
        if (tid == 0) {
            int acc = 0;
            for (int w = 0; w < kWarps; ++w) {
                const int c = seg_base[w];
                seg_base[w] = acc;
                acc += c;
            }
        }
        __syncthreads();
        return seg_base[warp];
    };
    int eq_before = 0;  // keys equal to thr in earlier segments (ties only)
    if (ties) {
        int eq = 0;
        for (int64_t j0 = s0; j0 < s1; j0 += 32) {
            const int64_t j = j0 + lane;
            eq += __popc(__ballot_sync(0xffffffffu, j < s1 && key_at(j) == thr));
        }
        eq_before = segment_bases(eq);
        __syncthreads();  // every warp read its base before seg_base is reused
    }
    // kept(j): above thr, or equal and among the first `need` equal keys.
    auto walk = [&](auto emit) {
        int eq_seen = eq_before;
        for (int64_t j0 = s0; j0 < s1; j0 += 32) {
            const int64_t j = j0 + lane;
            const uint32_t u = key_at(j);
            const bool valid = j < s1, eq = valid && u == thr;
            bool keep = valid && u > thr;
            if (ties) {
                const uint32_t eqb = __ballot_sync(0xffffffffu, eq);
                keep = keep || (eq && eq_seen + __popc(eqb & below) < need);
                eq_seen += __popc(eqb);
            } else {
                keep = keep || eq;
            }
            emit(j, keep, __ballot_sync(0xffffffffu, keep));
        }
    };
    int kept = 0;
    walk([&](int64_t, bool, uint32_t b) { kept += __popc(b); });
    int pos = segment_bases(kept);
    walk([&](int64_t j, bool keep, uint32_t b) {
        if (keep) r.out[pos + __popc(b & below)] = int32_t(r.begin + j);
        pos += __popc(b);
    });
    if (tid == 0) len[t] = int32_t(kslots);
}

}  // namespace

void topk_rows(const ExecContext& ctx, const float* scores, int64_t ld, const int32_t* row_begin,
               int64_t tokens, int64_t kslots, int32_t* idx, int32_t* len, const int32_t* key_row) {
    if (tokens == 0) return;
    topk_stream_kernel<<<unsigned(tokens), kThreads, 0, stream_of(ctx)>>>(
        scores, ld, row_begin, key_row, kslots, idx, len);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
