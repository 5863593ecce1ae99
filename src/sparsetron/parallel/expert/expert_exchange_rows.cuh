// Device helpers of the expert-parallel exchanges (expert_exchange.h): where a row sits in the
// owner layout, and a warp's copy of one row. Both transports (CUDA IPC pulls, NCCL blocks) move
// rows between the same two layouts:
// - source layout: rank p's permuted rows, expert-major by global expert (offsets [E + 1]);
// - owner layout: rank q's received rows, by local expert j, then by source rank p.
// all_offsets [W, E + 1] holds every rank's offsets; rank q owns experts [q El, (q + 1) El).
// A source sends an owner at most `pair` rows (the plan's budget per pair of ranks): the first
// `pair` of its rows for that owner's experts, in source-layout order; a source with more sets
// the exchange's over-budget flag (the step is redone) and its other rows are not moved.
#pragma once

#include <cstdint>

namespace sparsetron::cuda::exchange {

// The end of the source-layout rows that source offsets `o` send owner q: at most `pair` rows.
__device__ inline int32_t pair_end(const int32_t* o, int64_t el, int q, int64_t pair) {
    const int64_t first = o[q * el], last = o[(q + 1) * el];
    return int32_t(last - first > pair ? first + pair : last);
}

// Rows of owner q's local expert j that source offsets `o` send within the pair's budget.
__device__ inline int32_t kept_rows(const int32_t* o, int64_t el, int q, int64_t j, int64_t pair) {
    const int64_t cap = o[q * el] + pair, a = o[q * el + j], b = o[q * el + j + 1];
    return int32_t((b < cap ? b : cap) - (a < cap ? a : cap));
}

// base[j] (j < El): the owner-layout row of rank q where source p's rows of local expert j
// begin. One thread computes it (El values, W x El offsets read).
__device__ inline void owner_bases(const int32_t* all_offsets, int ranks, int64_t experts, int p,
                                   int q, int64_t pair, int32_t* base) {
    const int64_t el = experts / ranks, stride = experts + 1;
    int32_t at = 0;
    for (int64_t j = 0; j < el; ++j) {
        int32_t before = 0, total = 0;
        for (int r = 0; r < ranks; ++r) {
            const int32_t c = kept_rows(all_offsets + r * stride, el, q, j, pair);
            if (r < p) before += c;
            total += c;
        }
        base[j] = at + before;
        at += total;
    }
}

// recv_offsets [El + 1]: where each of rank q's local experts begins in its owner layout, and the
// rows received in all; *over_budget = 1 if a source has more rows for rank q than `pair`. One
// thread.
__device__ inline void owner_offsets(const int32_t* all_offsets, int ranks, int q, int64_t experts,
                                     int64_t pair, int32_t* recv_offsets, int32_t* over_budget) {
    const int64_t el = experts / ranks;
    int32_t at = 0;
    for (int64_t j = 0; j < el; ++j) {
        recv_offsets[j] = at;
        for (int s = 0; s < ranks; ++s)
            at += kept_rows(all_offsets + s * (experts + 1), el, q, j, pair);
    }
    recv_offsets[el] = at;
    for (int s = 0; s < ranks; ++s) {
        const int32_t* o = all_offsets + s * (experts + 1);
        if (o[(q + 1) * el] - o[q * el] > pair) *over_budget = 1;
    }
}

// The owner-layout row of source-layout row i of rank p (off_p: its offsets), which one of
// rank q's experts received (off_p[q El] <= i < pair_end(off_p, El, q, pair)).
__device__ inline int64_t owner_row(const int32_t* off_p, int64_t el, int q, const int32_t* base,
                                    int64_t i) {
    int64_t lo = 0, hi = el - 1;  // the local expert of row i: the last j with off <= i
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (off_p[q * el + mid] <= i)
            lo = mid;
        else
            hi = mid - 1;
    }
    return base[lo] + (i - off_p[q * el + lo]);
}

// A warp copies one row of dim_vec 16-byte vectors, four loads in flight per lane (remote and
// scattered reads are latency-bound); L2-only loads, since a peer may have written the row.
__device__ inline void copy_row(const int4* from, int4* to, int64_t dim_vec, int lane) {
    constexpr int kUnroll = 4;
    int64_t v = lane;
    for (; v + 32 * (kUnroll - 1) < dim_vec; v += 32 * kUnroll) {
        int4 r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) r[u] = __ldcg(from + v + 32 * u);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) to[v + 32 * u] = r[u];
    }
    for (; v < dim_vec; v += 32) to[v] = __ldcg(from + v);
}

}  // namespace sparsetron::cuda::exchange
