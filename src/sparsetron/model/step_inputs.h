// What every layer reads about the current micro-batch (planned input buffers).
#pragma once

#include <cstdint>

namespace sparsetron {

struct StepInputs {
    int64_t tokens = 0;  // token slots T
    const int32_t* token_ids = nullptr;
    const int32_t* positions = nullptr;   // position within the document, [T]
    const int32_t* cu_seqlens = nullptr;  // [max_docs + 1]
    int64_t num_docs = 0;
};

}  // namespace sparsetron
