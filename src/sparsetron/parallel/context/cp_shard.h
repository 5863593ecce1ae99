// Context parallelism on THD (SPEC §10): each document of a micro-batch is cut into 2·cp equal
// chunks and rank r holds chunks r and 2cp-1-r, so every rank gets the same causal attention work
// (an early chunk with few keys paired with a late one with many). Documents are padded to a
// multiple of 2·cp; padding rows belong to no document.
#pragma once

#include <cstdint>
#include <vector>

namespace sparsetron {

struct RowRange {
    int64_t begin = 0, end = 0;  // [begin, end) rows of the document
    int64_t size() const { return end - begin; }
};

// Rows of a document of `length` rows that CP rank `rank` of `cp` holds: two ranges (in document
// order), each ceil(length / 2cp) long except where the document ends.
std::vector<RowRange> cp_rows(int64_t length, int cp, int rank);
// For every local row of that rank, its row in the document (the positions RoPE and the causal
// mask use); the two chunks concatenated.
std::vector<int64_t> cp_positions(int64_t length, int cp, int rank);
// Causal attention work of a rank: Σ over its rows of the keys they see (row index + 1).
int64_t cp_causal_pairs(int64_t length, int cp, int rank);
// Rows a CP rank may hold of a micro-batch of `tokens` slots and up to `max_docs` documents:
// each document gives a rank two chunks of ceil(L / 2cp) < L / 2cp + 1 rows, so fewer than
// tokens / cp + 2 max_docs in all (the rank's planned row count).
int64_t cp_local_tokens(int64_t tokens, int64_t max_docs, int cp);

}  // namespace sparsetron
