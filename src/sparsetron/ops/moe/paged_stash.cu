// The paged stash on the device (semantics: ops/moe/paged_stash.h, CPU reference
// ops/moe/paged_stash_cpu.cpp). A push is two kernels: one block takes the pages (free-list stack,
// statistics, overflow flag), then one block per row copies the row into its page; a pop copies
// back, then one block returns the pages. Row counts are read from device memory, so nothing
// here needs the host: it runs inside a captured step.
#include <algorithm>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/moe/paged_stash.h"

namespace sparsetron::cuda {

namespace {

constexpr int kThreads = 256;

struct Segments {
    uint16_t* data[kStashMaxSegments];
    int64_t width[kStashMaxSegments];
    int count;
    int64_t row_width;
    bool vec;  // every row start 16-byte aligned: copy uint4 (8 bf16) at a time
};

Segments segments_of(const StashRows& s) {
    Segments g{};
    g.count = s.count;
    g.row_width = s.row_width();
    g.vec = g.row_width % 8 == 0;
    for (int i = 0; i < s.count; ++i) {
        g.data[i] = reinterpret_cast<uint16_t*>(s.data[i]);
        g.width[i] = s.width[i];
        g.vec = g.vec && s.width[i] % 8 == 0 && reinterpret_cast<uintptr_t>(s.data[i]) % 16 == 0;
    }
    return g;
}

__global__ void reset_kernel(int32_t* state, int32_t* free_list, int64_t pages, bool new_step) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pages;
         i += int64_t(gridDim.x) * blockDim.x)
        free_list[i] = int32_t(i);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        state[0] = int32_t(pages);
        state[4] = 0;
        if (new_step) state[1] = state[2] = state[3] = 0;
    }
}

__global__ void take_pages_kernel(int32_t* state, const int32_t* free_list, int64_t pages,
                                  int32_t* table, int64_t max_rows, const int32_t* rows_ptr,
                                  int64_t page_rows) {
    __shared__ int32_t s_free, s_n, s_ok;
    if (threadIdx.x == 0) {
        const int32_t n = int32_t((int64_t(*rows_ptr) + page_rows - 1) / page_rows);
        s_free = state[0];
        s_n = n;
        s_ok = n <= s_free && *rows_ptr <= max_rows;
        state[4] += n;
        state[3] = max(state[3], state[4]);
        if (!s_ok) {
            table[0] = -n;
            state[2] = 1;
        } else {
            table[0] = n;
            state[0] = s_free - n;
            state[1] = max(state[1], int32_t(pages) - (s_free - n));
        }
    }
    __syncthreads();
    if (!s_ok) return;
    for (int32_t i = threadIdx.x; i < s_n; i += blockDim.x)
        table[1 + i] = free_list[s_free - 1 - i];
}

__global__ void give_pages_kernel(int32_t* state, int32_t* free_list, const int32_t* table) {
    __shared__ int32_t s_free;
    const int32_t n = table[0];
    if (threadIdx.x == 0) {
        s_free = state[0];
        state[4] -= n < 0 ? -n : n;
        if (n > 0) state[0] = s_free + n;
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) free_list[s_free + i] = table[n - i];
}

// One block per row of the push: pool row <-> the segments' rows (to_pool picks the direction).
__global__ void copy_rows_kernel(Segments seg, const int32_t* table, const int32_t* rows_ptr,
                                 int64_t page_rows, uint16_t* pool, bool to_pool) {
    const int64_t r = blockIdx.x;
    if (table[0] <= 0 || r >= *rows_ptr) return;
    uint16_t* prow =
        pool + (int64_t(table[1 + r / page_rows]) * page_rows + r % page_rows) * seg.row_width;
    for (int s = 0; s < seg.count; ++s) {
        uint16_t* trow = seg.data[s] + r * seg.width[s];
        const int64_t w = seg.width[s];
        if (seg.vec) {
            uint4* p = reinterpret_cast<uint4*>(prow);
            uint4* t = reinterpret_cast<uint4*>(trow);
            for (int64_t i = threadIdx.x; i < w / 8; i += blockDim.x) {
                if (to_pool)
                    p[i] = t[i];
                else
                    t[i] = p[i];
            }
        } else {
            for (int64_t i = threadIdx.x; i < w; i += blockDim.x) {
                if (to_pool)
                    prow[i] = trow[i];
                else
                    trow[i] = prow[i];
            }
        }
        prow += w;
    }
}

}  // namespace

void stash_reset(const ExecContext& ctx, int32_t* state, int32_t* free_list, int64_t pages,
                 bool new_step) {
    const unsigned blocks = std::max(1u, std::min(blocks_for(pages, kThreads), 64u));
    reset_kernel<<<blocks, kThreads, 0, stream_of(ctx)>>>(state, free_list, pages, new_step);
    ST_CUDA_LAUNCH_CHECK();
}

void stash_push(const ExecContext& ctx, int32_t* state, int32_t* free_list, int64_t pages,
                int32_t* table, int64_t max_rows, const int32_t* rows_ptr, int64_t page_rows,
                const StashRows& src, bf16* pool) {
    ST_CHECK(src.count >= 1 && src.count <= kStashMaxSegments && page_rows > 0, "stash_push: 1..",
             kStashMaxSegments, " segments and page_rows > 0");
    cudaStream_t s = stream_of(ctx);
    take_pages_kernel<<<1, kThreads, 0, s>>>(state, free_list, pages, table, max_rows, rows_ptr,
                                             page_rows);
    if (max_rows > 0)
        copy_rows_kernel<<<unsigned(max_rows), 128, 0, s>>>(
            segments_of(src), table, rows_ptr, page_rows, reinterpret_cast<uint16_t*>(pool), true);
    ST_CUDA_LAUNCH_CHECK();
}

void stash_pop(const ExecContext& ctx, int32_t* state, int32_t* free_list, const int32_t* table,
               int64_t max_rows, const int32_t* rows_ptr, int64_t page_rows, const StashRows& dst,
               const bf16* pool) {
    ST_CHECK(dst.count >= 1 && dst.count <= kStashMaxSegments && page_rows > 0, "stash_pop: 1..",
             kStashMaxSegments, " segments and page_rows > 0");
    cudaStream_t s = stream_of(ctx);
    if (max_rows > 0)
        copy_rows_kernel<<<unsigned(max_rows), 128, 0, s>>>(
            segments_of(dst), table, rows_ptr, page_rows,
            const_cast<uint16_t*>(reinterpret_cast<const uint16_t*>(pool)), false);
    give_pages_kernel<<<1, kThreads, 0, s>>>(state, free_list, table);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
