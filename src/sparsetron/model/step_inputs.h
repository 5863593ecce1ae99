// What every layer reads about the current micro-batch (planned input buffers).
#pragma once

#include <cstdint>

namespace sparsetron {

class Comm;

struct StepInputs {
    int64_t tokens = 0;  // token slots T this rank computes
    const int32_t* token_ids = nullptr;
    const int32_t* positions = nullptr;   // position within the document, [T]
    const int32_t* cu_seqlens = nullptr;  // [max_docs + 1]
    int64_t num_docs = 0;

    // Context parallelism (SPEC §10): this rank computes some rows of the micro-batch (two
    // chunks of every document) and the attention and indexer read keys of all of them. Without
    // it the rows are the micro-batch: key_tokens == tokens, key_row[i] == i, key_cu_seqlens ==
    // cu_seqlens, cp == nullptr.
    int64_t key_tokens = 0;                   // micro-batch rows (keys are indexed by these)
    const int32_t* key_row = nullptr;         // [T]: each row's micro-batch row (-1: padding)
    const int32_t* key_cu_seqlens = nullptr;  // the micro-batch's cu_seqlens (same documents)
    Comm* cp = nullptr;                       // the CP group; null: one rank holds every row
    // The indexer KL's divisor under per-token loss (LossScales::indexer_tokens); 0: the
    // micro-batch's rows.
    int64_t indexer_tokens = 0;
};

// The key-side view, also for inputs built without the CP fields (tests of one layer).
inline int64_t key_rows(const StepInputs& in) {
    return in.key_tokens > 0 ? in.key_tokens : in.tokens;
}
inline int64_t key_row(const StepInputs& in, int64_t row) {
    return in.key_row ? in.key_row[row] : row;
}
inline const int32_t* key_cu_seqlens(const StepInputs& in) {
    return in.key_cu_seqlens ? in.key_cu_seqlens : in.cu_seqlens;
}

}  // namespace sparsetron
