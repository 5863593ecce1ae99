// The MoE's paged stash on CUDA (recipe key moe_paged_stash; Megatron's --moe-paged-stash).
//
// Without it every MoE application (each MoE layer, and the MTP layer once per depth) keeps its
// own worst-case-sized copies of what its backward reads: the permuted input, the expert gate /
// up outputs and their SwiGLU, tokens x top-k rows each. With it the expert computation runs in
// one set of working buffers shared by all applications; after an application's forward, the
// rows it actually routed of the two tensors its backward cannot recompute cheaply (gate and up
// outputs) are copied into pages of one shared pool, taken from a device-side free list; its
// backward copies them back, re-gathers the permuted input from the layer's saved MoE input and
// recomputes the SwiGLU (bit-identical), then returns the pages. Under expert parallelism the
// kept rows are those the rank's experts received, with their input rows in the pages too (the
// backward could only gather them again through another exchange). (The expert outputs are not
// saved with or without the stash: the backward does not read them, model/cuda/moe.h.) The pool is
// sized from a bound (moe_stash_bound.h):
//
//   pages = ceil(moe_paged_stash_buffer_size_factor_cuda x applications x ceil(R / page rows))
//
// with R = min(tokens x top-k, capacity x experts) the most rows one application can route: under
// expert parallelism what its experts receive on balanced routing (a rank receives what it sends;
// imbalanced routing can send it up to the receive bound). Without expert parallelism a factor of
// 1 never overflows; a smaller one (or imbalance under expert parallelism) trades memory for the
// risk that a step keeps more rows than the pool holds (padding rows are not routed, dropped rows
// are not kept). A push that
// finds too few free pages keeps nothing and raises a device flag: the optimizer step is skipped
// on the device, and the engine runs the step again eagerly with the stash bypassed (as the seed
// falls back to an eager step): every application's backward then recomputes its expert rows
// from the layer's saved MoE input (the forward's gather, grouped GEMMs and SwiGLU again), so the
// redo needs no pages and no memory beyond the plan.
#pragma once

#include <string>

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/cuda/cuda_common.h"
#include "sparsetron/model/moe_stash_bound.h"
#include "sparsetron/ops/moe/paged_stash.h"

namespace sparsetron::cuda {

class MoeStash {
  public:
    // What one step used, read after it.
    struct Use {
        int64_t pool_pages = 0, page_rows = 0;
        int64_t peak_pages = 0;    // most pages in use at once
        int64_t demand_pages = 0;  // what the pool would have needed (> pool_pages on overflow)
        bool overflow = false;
    };

    // `row_width`: bf16 values per stashed row (gate + up outputs).
    MoeStash(const ModelConfig& c, CudaBuffers& B, int64_t tokens, int64_t row_width,
             const std::vector<PipelineStage>& stages = {});
    // A page table for one application (its pages between its forward and backward).
    void declare_table(int32_t*& table, CudaBuffers& B, const std::string& prefix) const;
    const MoeStashBound& bound() const { return bound_; }

    // Start of a micro-batch: every page free (a forward-only micro-batch pops nothing). With
    // new_step the statistics and the overflow flag are cleared too.
    void reset(const ExecContext& ctx, bool new_step) const;
    void push(const ExecContext& ctx, int32_t* table, const int32_t* rows,
              const StashRows& src) const;
    void pop(const ExecContext& ctx, const int32_t* table, const int32_t* rows,
             const StashRows& dst) const;
    // Device int32: nonzero once a push of this step overflowed (the optimizer's veto). With
    // several processes the engine takes its maximum over all of them before the optimizer, so
    // every rank skips and redoes the step together (the redo's collectives need all of them).
    int32_t* overflow_flag() const { return state_ + 2; }
    Use read(const ExecContext& ctx) const;  // synchronizes
    // Bypassed (host-side, for an eager redo of an overflowed step): the MoE layers push and pop
    // nothing and their backward recomputes the expert rows. Never inside a captured graph.
    void set_bypass(bool on) { bypass_ = on; }
    bool bypassed() const { return bypass_; }

  private:
    MoeStashBound bound_;
    int64_t page_rows_, max_rows_, pages_, row_width_;
    int32_t *state_ = nullptr, *free_ = nullptr;
    bf16* pool_ = nullptr;
    bool bypass_ = false;
};

}  // namespace sparsetron::cuda
