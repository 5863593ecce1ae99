#include "sparsetron/parallel/context/cp_shard.h"

#include <algorithm>

#include "sparsetron/core/error.h"

namespace sparsetron {

std::vector<RowRange> cp_rows(int64_t length, int cp, int rank) {
    ST_CHECK(cp >= 1 && rank >= 0 && rank < cp, "CP rank ", rank, " of ", cp);
    const int64_t chunks = 2 * int64_t(cp), chunk = (length + chunks - 1) / chunks;
    auto range = [&](int64_t c) {
        return RowRange{std::min(length, c * chunk), std::min(length, (c + 1) * chunk)};
    };
    return {range(rank), range(chunks - 1 - rank)};
}

std::vector<int64_t> cp_positions(int64_t length, int cp, int rank) {
    std::vector<int64_t> out;
    for (const RowRange& r : cp_rows(length, cp, rank))
        for (int64_t i = r.begin; i < r.end; ++i) out.push_back(i);
    return out;
}

int64_t cp_local_tokens(int64_t tokens, int64_t max_docs, int cp) {
    ST_CHECK(cp >= 1, "CP size ", cp);
    if (cp == 1) return tokens;
    return std::min(tokens, (tokens + cp - 1) / cp + 2 * max_docs);
}

int64_t cp_causal_pairs(int64_t length, int cp, int rank) {
    int64_t pairs = 0;
    for (int64_t p : cp_positions(length, cp, rank)) pairs += p + 1;
    return pairs;
}

}  // namespace sparsetron
