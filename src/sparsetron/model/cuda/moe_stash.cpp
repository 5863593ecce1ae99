#include "sparsetron/model/cuda/moe_stash.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/moe/paged_stash.h"

namespace sparsetron::cuda {

MoeStash::MoeStash(const ModelConfig& c, CudaBuffers& B, int64_t tokens, int64_t row_width,
                   const std::vector<PipelineStage>& stages)
    : bound_(moe_stash_bound(c, tokens, stages)),
      page_rows_(bound_.page_rows),
      max_rows_(bound_.max_rows),
      pages_(bound_.pool_pages),
      row_width_(row_width) {
    B.act(state_, "moe.paged_stash.state", {kStashStateWords});
    B.act(free_, "moe.paged_stash.free_list", {pages_});
    B.act(pool_, "moe.paged_stash.pool", {pages_ * page_rows_, row_width_});
}

void MoeStash::declare_table(int32_t*& table, CudaBuffers& B, const std::string& prefix) const {
    B.act(table, prefix + "stash_pages", {1 + (max_rows_ + page_rows_ - 1) / page_rows_});
}

void MoeStash::reset(const ExecContext& ctx, bool new_step) const {
    cuda::stash_reset(ctx, state_, free_, pages_, new_step);
}

void MoeStash::push(const ExecContext& ctx, int32_t* table, const int32_t* rows,
                    const StashRows& src) const {
    ST_ASSERT(src.row_width() == row_width_, "MoeStash: rows of ", src.row_width(),
              " values pushed into a pool of ", row_width_);
    cuda::stash_push(ctx, state_, free_, pages_, table, max_rows_, rows, page_rows_, src, pool_);
}

void MoeStash::pop(const ExecContext& ctx, const int32_t* table, const int32_t* rows,
                   const StashRows& dst) const {
    cuda::stash_pop(ctx, state_, free_, table, max_rows_, rows, page_rows_, dst, pool_);
}

MoeStash::Use MoeStash::read(const ExecContext& ctx) const {
    int32_t s[kStashStateWords];
    cuda::download(ctx, s, state_, sizeof(s));
    Use u;
    u.pool_pages = pages_;
    u.page_rows = page_rows_;
    u.peak_pages = s[1];
    u.overflow = s[2] != 0;
    u.demand_pages = s[3];
    return u;
}

}  // namespace sparsetron::cuda
