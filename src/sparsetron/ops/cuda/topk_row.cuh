// What every DSA top-k kernel (indexer.cu, topk_stream.cu) does per row before selecting: the
// row's keys [begin, last], the order-preserving integer image of a score, and the short-row
// case (no more keys than slots: all of them, ascending, -1 padding).
#pragma once

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

}  // namespace sparsetron::cuda
