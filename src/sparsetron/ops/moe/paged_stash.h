// The paged stash: rows of saved activations moved out of a worst-case-sized working buffer into
// fixed-size pages of one shared pool, so the memory a step keeps for backward follows the rows
// actually routed (the CUDA MoE, model/cuda/moe_stash.h). Everything a push or pop needs lives in
// device memory (row count, free list, page table), so it runs inside a captured CUDA graph.
//
// Words of `state` (int32):
//   [0] free pages (the free list is a stack: free_list[0 .. state[0]) are free page ids)
//   [1] most pages in use at once since the last reset with new_step
//   [2] overflow: 1 once a push found too few free pages (that push keeps nothing)
//   [3] most pages that would have been in use at once had every push fitted: what the pool
//       must hold (equals [1] when nothing overflowed)
//   [4] pages asked for by the pushes not yet popped (the running demand behind [3])
// A page table (int32 [1 + max_pages]) holds one push's page count (-n: the push of n pages
// overflowed and keeps nothing), then its page ids in row order: row r of the push is row r %
// page_rows of page table[1 + r / page_rows]. A pool row is the concatenation of the segments'
// rows.
//
// CPU reference: paged_stash_cpu.cpp; CUDA: paged_stash.cu, the same contract with the state on
// the device. Tests: tests/ops/test_paged_stash.cpp, tests/gpu/ops/test_moe_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"

namespace sparsetron {

constexpr int kStashStateWords = 5;
constexpr int kStashMaxSegments = 3;

// Up to three row-major bf16 tensors [rows, width_i] stashed row by row together.
struct StashRows {
    bf16* data[kStashMaxSegments] = {nullptr, nullptr, nullptr};
    int64_t width[kStashMaxSegments] = {0, 0, 0};
    int count = 0;
    int64_t row_width() const {
        int64_t w = 0;
        for (int i = 0; i < count; ++i) w += width[i];
        return w;
    }
};

namespace cpu {

// Every page free (free_list = 0 .. pages-1 from the bottom), no demand; with new_step also the
// statistics and the overflow flag cleared.
void stash_reset(int32_t* state, int32_t* free_list, int64_t pages, bool new_step);
// Takes n = ceil(rows / page_rows) pages of the pool's `pages` for this push (rows = *rows_ptr)
// and copies rows 0 .. rows-1 of `src` into them; too few free pages (or rows > max_rows, the
// bound the table was sized for: 1 + ceil(max_rows / page_rows) words) sets the overflow flag
// and table[0] = -n instead.
void stash_push(int32_t* state, int32_t* free_list, int64_t pages, int32_t* table, int64_t max_rows,
                const int32_t* rows_ptr, int64_t page_rows, const StashRows& src, bf16* pool);
// Copies a push's rows back into `dst` and returns its pages to the free list (an overflowed
// push only gives back its demand).
void stash_pop(int32_t* state, int32_t* free_list, const int32_t* table, const int32_t* rows_ptr,
               int64_t page_rows, const StashRows& dst, const bf16* pool);

}  // namespace cpu

namespace cuda {

// Every page of the pool free; with new_step the statistics and the overflow flag cleared too.
void stash_reset(const ExecContext& ctx, int32_t* state, int32_t* free_list, int64_t pages,
                 bool new_step);
// Rows 0 .. *rows_ptr - 1 of `src` into freshly taken pages of the pool (`pages` pages of
// page_rows x src.row_width() bf16); `table` has 1 + ceil(max_rows / page_rows) words and
// *rows_ptr <= max_rows (a larger count is treated as an overflow).
void stash_push(const ExecContext& ctx, int32_t* state, int32_t* free_list, int64_t pages,
                int32_t* table, int64_t max_rows, const int32_t* rows_ptr, int64_t page_rows,
                const StashRows& src, bf16* pool);
// The rows of the push recorded in `table` back into `dst`, then its pages back to the free list.
void stash_pop(const ExecContext& ctx, int32_t* state, int32_t* free_list, const int32_t* table,
               int64_t max_rows, const int32_t* rows_ptr, int64_t page_rows, const StashRows& dst,
               const bf16* pool);

}  // namespace cuda
}  // namespace sparsetron
