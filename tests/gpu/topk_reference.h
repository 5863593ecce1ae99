// The CPU rule for the DSA top-k (SPEC §3), shared by the GPU tests that check topk_rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace sparsetron::test {

// The k largest of row[begin, begin + n), ties toward the smaller index, written ascending and
// padded with -1 to k entries. `row` is indexed by key: row[begin] is the first candidate.
inline std::vector<int32_t> reference_topk(const float* row, int32_t begin, int64_t n, int64_t k) {
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), begin);
    const int64_t kk = std::min(k, n);
    std::partial_sort(order.begin(), order.begin() + kk, order.end(), [&](int32_t x, int32_t y) {
        return row[x] > row[y] || (row[x] == row[y] && x < y);
    });
    order.resize(kk);
    std::sort(order.begin(), order.end());
    order.resize(k, -1);
    return order;
}

}  // namespace sparsetron::test
