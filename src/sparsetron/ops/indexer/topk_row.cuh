// What the DSA top-k kernels (indexer.cu, topk_stream.cu) share per row: the row's keys
// [begin, last], the order-preserving integer image of a score, the short-row case (no more keys
// than slots: all of them, ascending, -1 padding) and the radix select of the threshold.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace sparsetron::cuda {

// Query row t is key row `row` (key_row[t] under context parallelism, else t); keys: key rows.
__device__ __forceinline__ int64_t query_key_row(const int32_t* key_row, int64_t t) {
    return key_row ? int64_t(key_row[t]) : t;
}

// Larger float, larger unsigned (negative values flipped, positive ones offset).
__device__ __forceinline__ uint32_t order_key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Row t of a top-k launch (one block per row): n keys starting at key `begin`, the scores from
// `row` (row[0] is key begin), the output slots at `out`.
struct TopkRow {
    int32_t begin;
    int64_t n;
    const float* row;
    int32_t* out;
};
__device__ __forceinline__ TopkRow topk_row(const float* scores, int64_t ld,
                                            const int32_t* row_begin, const int32_t* key_row,
                                            int64_t kslots, int32_t* idx, int64_t t) {
    const int32_t begin = row_begin[t];
    const int64_t n = begin < 0 ? 0 : query_key_row(key_row, t) - begin + 1;
    return {begin, n, scores + t * ld + (begin < 0 ? 0 : begin), idx + t * kslots};
}

// A row of at most kslots keys keeps them all (padding rows: none); true when it was written.
__device__ __forceinline__ bool topk_short_row(const TopkRow& r, int64_t kslots, int32_t* len,
                                               int64_t t) {
    if (r.n > kslots) return false;
    for (int64_t j = threadIdx.x; j < kslots; j += blockDim.x)
        r.out[j] = j < r.n ? int32_t(r.begin + j) : -1;
    if (threadIdx.x == 0) len[t] = int32_t(r.n);
    return true;
}

// The radix select's shared memory for a block of kThreads threads.
constexpr int kTopkCandidates = 4096;  // threshold-bin keys the later passes read from here
template <int kThreads>
struct TopkSelectShared {
    typename cub::BlockScan<int, kThreads>::TempStorage scan;
    int hist[2048];
    uint32_t cand[kTopkCandidates];
    uint32_t prefix;
    int remaining, bin_count, cand_n;
};

// The kslots-th largest key `thr`, how many keys equal to it are kept (`need`, the smallest
// indices) and how many there are (`equal`; need == equal: no tie straddles the k-th place).
struct TopkThreshold {
    uint32_t thr;
    int need, equal;
};

// Exact radix select over the row's keys in 3 passes of 11 / 11 / 10 bits from the top.
// for_each_key(f) calls f(u) for every key this thread holds (any order). Pass 1 sees every key;
// the keys in the threshold's bin (a few percent of a row of real scores) are then copied to
// shared memory and passes 2 and 3 read only them (for_each_key again when the bin holds more
// than kTopkCandidates). Thread i owns 2048 / kThreads bins from the top; a block scan counts the
// keys above them, and the thread whose bins hold the k-th key publishes it.
template <int kThreads, class ForEachKey>
__device__ __forceinline__ TopkThreshold topk_threshold(TopkSelectShared<kThreads>& sm,
                                                        int64_t kslots, ForEachKey for_each_key) {
    constexpr int kBinsPerThread = 2048 / kThreads;
    using Scan = cub::BlockScan<int, kThreads>;
    const int tid = threadIdx.x;
    uint32_t prefix = 0, mask = 0;
    int remaining = int(kslots), bin_count = 0;
    bool from_cand = false;
    if (tid == 0) sm.cand_n = 0;  // published by the first pass's barrier
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bins = pass == 2 ? 1024 : 2048;
        for (int i = tid; i < bins; i += kThreads) sm.hist[i] = 0;
        __syncthreads();
        if (from_cand) {
            for (int i = tid; i < sm.cand_n; i += kThreads)
                if ((sm.cand[i] & mask) == prefix)
                    atomicAdd(&sm.hist[(sm.cand[i] >> shift) & (bins - 1)], 1);
        } else {
            for_each_key([&](uint32_t u) {
                if ((u & mask) == prefix) atomicAdd(&sm.hist[(u >> shift) & (bins - 1)], 1);
            });
        }
        __syncthreads();
        const int top = bins - 1 - kBinsPerThread * tid;
        int c[kBinsPerThread], mine = 0;
#pragma unroll
        for (int k = 0; k < kBinsPerThread; ++k) {
            c[k] = top - k >= 0 ? sm.hist[top - k] : 0;
            mine += c[k];
        }
        int above;
        Scan(sm.scan).ExclusiveSum(mine, above);
        if (above < remaining && above + mine >= remaining) {
#pragma unroll
            for (int k = 0; k < kBinsPerThread; ++k) {
                if (above + c[k] >= remaining) {
                    sm.prefix = prefix | (uint32_t(top - k) << shift);
                    sm.remaining = remaining - above;
                    sm.bin_count = c[k];
                    break;
                }
                above += c[k];
            }
        }
        __syncthreads();
        prefix = sm.prefix, remaining = sm.remaining, bin_count = sm.bin_count;
        mask |= uint32_t(bins - 1) << shift;
        if (pass == 0 && bin_count <= kTopkCandidates) {
            for_each_key([&](uint32_t u) {
                if ((u & mask) == prefix) sm.cand[atomicAdd(&sm.cand_n, 1)] = u;
            });
            from_cand = true;  // the next pass's first barrier publishes cand and cand_n
        }
    }
    return {prefix, remaining, bin_count};
}

}  // namespace sparsetron::cuda
