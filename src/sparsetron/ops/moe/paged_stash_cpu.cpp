// CPU reference of the paged stash (ops/moe/paged_stash.h): the semantics the CUDA kernels match.
#include "sparsetron/ops/moe/paged_stash.h"

#include <algorithm>
#include <cstring>

namespace sparsetron::cpu {

namespace {

// The pool row that row r of a push lives in.
int64_t pool_row(const int32_t* table, int64_t r, int64_t page_rows) {
    return int64_t(table[1 + r / page_rows]) * page_rows + r % page_rows;
}

}  // namespace

void stash_reset(int32_t* state, int32_t* free_list, int64_t pages, bool new_step) {
    for (int64_t i = 0; i < pages; ++i) free_list[i] = int32_t(i);
    state[0] = int32_t(pages);
    state[4] = 0;
    if (new_step) state[1] = state[2] = state[3] = 0;
}

void stash_push(int32_t* state, int32_t* free_list, int64_t pages, int32_t* table, int64_t max_rows,
                const int32_t* rows_ptr, int64_t page_rows, const StashRows& src, bf16* pool) {
    const int64_t rows = *rows_ptr, n = (rows + page_rows - 1) / page_rows;
    const int64_t free = state[0];
    state[4] += int32_t(n);
    state[3] = std::max(state[3], state[4]);
    if (n > free || rows > max_rows) {
        table[0] = int32_t(-n);
        state[2] = 1;
        return;
    }
    for (int64_t i = 0; i < n; ++i) table[1 + i] = free_list[free - 1 - i];
    table[0] = int32_t(n);
    state[0] = int32_t(free - n);
    state[1] = std::max(state[1], int32_t(pages - state[0]));
    const int64_t width = src.row_width();
    for (int64_t r = 0; r < rows; ++r) {
        bf16* dst = pool + pool_row(table, r, page_rows) * width;
        for (int s = 0; s < src.count; ++s) {
            std::memcpy(dst, src.data[s] + r * src.width[s], size_t(src.width[s]) * sizeof(bf16));
            dst += src.width[s];
        }
    }
}

void stash_pop(int32_t* state, int32_t* free_list, const int32_t* table, const int32_t* rows_ptr,
               int64_t page_rows, const StashRows& dst, const bf16* pool) {
    const int64_t n = table[0];
    state[4] -= int32_t(n < 0 ? -n : n);
    if (n < 0) return;
    const int64_t rows = *rows_ptr, width = dst.row_width();
    for (int64_t r = 0; r < rows; ++r) {
        const bf16* src = pool + pool_row(table, r, page_rows) * width;
        for (int s = 0; s < dst.count; ++s) {
            std::memcpy(dst.data[s] + r * dst.width[s], src, size_t(dst.width[s]) * sizeof(bf16));
            src += dst.width[s];
        }
    }
    const int64_t free = state[0];
    for (int64_t i = 0; i < n; ++i) free_list[free + i] = table[n - i];
    state[0] = int32_t(free + n);
}

}  // namespace sparsetron::cpu
