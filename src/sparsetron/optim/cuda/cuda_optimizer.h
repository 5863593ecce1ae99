// The optimizer on CUDA (the CPU Optimizer, optim/optimizer.h): global-norm clipping by group
// with device scalars (the MTP layer is its own group when its heads are detached), a non-finite
// norm skips the whole step, fused AdamW writing the bf16 copies, Muon (per-head or per-projection
// splits, batched Newton-Schulz through cuBLASLt) for the 2-D weights when the recipe asks for it.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/run_config.h"
#include "sparsetron/cuda/side_stream.h"
#include "sparsetron/model/cuda/cuda_common.h"
#include "sparsetron/ops/optim/muon_batch.h"
#include "sparsetron/optim/muon.h"
#include "sparsetron/optim/muon_batches.h"
#include "sparsetron/optim/optimizer.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron::cuda {

class CudaOptimizer {
  public:
    // With `distributed` (a data-parallel communicator of more than one rank with device
    // collectives: the distributed optimizer), AdamW state and updates are sharded by parameter
    // (owners broadcast the new weights) and Muon's Newton-Schulz batches are split over the
    // ranks (results all-gathered, every rank applies all of them); Muon momentum stays whole on
    // every rank.
    // With `expert_parallel` (more than one rank: the routed experts are sharded), each rank
    // updates its own experts (state kept here, never broadcast, Newton-Schulz outside the
    // distributed split) and their squared gradient norms are summed over the group.
    // With `pipeline` (one rank per stage, more than one stage): the clipping norms are summed
    // over the stages; a pipeline copy (the last stage's embedding) counts on the first stage
    // only, and is updated on both from the same summed gradient.
    CudaOptimizer(const CudaParams& P, MemoryPlan& plan, const ModelConfig& m, const RunConfig& r,
                  Comm* distributed = nullptr, Comm* expert_parallel = nullptr,
                  Comm* pipeline = nullptr);
    void bind(const MemoryPlan& plan);
    // Distributed: creates the side stream its collectives overlap on (once, outside a step).
    void prepare(const ExecContext& ctx);
    // The learning rate and AdamW's bias corrections of `step` into device scalars (a host
    // copy: outside any captured graph). The step's kernels read them there, so a replayed graph
    // follows the schedule.
    void stage_schedule(const ExecContext& ctx, const RunConfig& run, int64_t step);
    // One step on the staged schedule, enqueued only (capturable); read_stats() downloads the
    // norms and the skip flag.
    void enqueue_step(const ExecContext& ctx, const RunConfig& run);
    StepStats read_stats(const ExecContext& ctx, const RunConfig& run, int64_t step) const;
    StepStats step(const ExecContext& ctx, const RunConfig& run, int64_t step) {
        stage_schedule(ctx, run, step);
        enqueue_step(ctx, run);
        return read_stats(ctx, run, step);
    }
    // A device int32 that, when nonzero at the step, skips it like a non-finite norm does
    // (the MoE stash's overflow flag).
    void set_veto(const int32_t* flag) { veto_ = flag; }
    // Distributed: the rank holding each parameter's AdamW state (-1: Muon momentum, on every
    // rank, or no state); empty otherwise.
    std::vector<int> state_owners() const;
    // Device state tensors by checkpoint name ("<param>.exp_avg", ...); distributed: this rank's.
    std::vector<std::pair<std::string, MemoryPlan::Slot>> state_tensors() const;

  private:
    void plan_muon(MemoryPlan& plan, const RunConfig& r, int64_t max_numel);
    void bind_muon(const MemoryPlan& plan);
    // Newton-Schulz and the update of every Muon matrix, batch by batch (the momentum updated in
    // the gather, or before it when not fused_momentum_).
    void run_muon_batches(const ExecContext& ctx, const RunConfig& run);
    // A parameter whose gradient the clipping norm counts.
    static bool normed(const ParamInfo& p) { return p.trainable && !p.pipeline_copy; }
    const CudaParams& P_;
    const ModelConfig& cfg_;
    Comm* dist_ = nullptr;
    Comm* ep_ = nullptr;
    Comm* pp_ = nullptr;
    MemoryPlan::Slot s_stage_sums_ = -1;
    float* stage_sums_ = nullptr;  // pipeline: [main, MTP] sums of squares, over the stages
    std::vector<bool> local_;      // a sharded routed expert's weight: this rank's alone
    int rank_ = 0, ranks_ = 1;
    std::vector<int> adam_owner_;  // AdamW parameters' owning rank, -1 for the others
    bool muon_ = false, separate_mtp_ = false;
    // Muon's momentum updated inside the batches' gather (one pass over G and M, not two). Not
    // when distributed: there a batch is gathered on one rank, but every rank keeps (and
    // checkpoints) every momentum.
    bool fused_momentum_ = false;
    std::vector<bool> uses_muon_;
    std::vector<MemoryPlan::Slot> m_slots_, v_slots_, mom_slots_;
    std::vector<MuonSplit> splits_;
    std::vector<int64_t> part_off_;  // first partial-sum block of each parameter
    int64_t parts_main_ = 0, parts_total_ = 0;
    std::array<std::pair<int64_t, int64_t>, 2> expert_parts_{};  // per group: (first, count)
    MemoryPlan::Slot s_parts_, s_norm_, s_scale_, s_skip_, s_sched_;
    float *parts_ = nullptr, *norm_ = nullptr, *scale_ = nullptr;
    // Muon: Newton-Schulz batches, their workspace and the device table of their problems.
    std::vector<MuonBatch> batches_;  // the shared batches first, then this rank's own
    int64_t shared_batches_ = 0;
    std::vector<int64_t> batch_first_;        // each batch's first row in the problem table
    std::vector<std::vector<int>> rounds_;    // [round][rank] -> batch, -1 for none
    std::vector<int64_t> round_elements_;     // per round: its largest batch's elements
    int64_t ns_stack_ = 0;                    // elements of the largest batch
    int ns_buffers_ = 1;                      // slot buffers (2: pipelined all-gathers)
    std::unique_ptr<cuda::SideStream> side_;  // distributed: broadcasts and all-gathers
    // Newton-Schulz element type per form: the standard iteration in ns_elem_; the Gram form
    // (muon_ns_method: gram, on the batches where it costs less) in fp16 where ns_elem_ is bf16.
    DType ns_elem_ = DType::F32, ns_gram_elem_ = DType::F32;
    bool ns_tf32_ = false;
    std::vector<char> gram_;  // per batch: runs the Gram form
    DType elem_of(size_t batch) const { return gram_[batch] ? ns_gram_elem_ : ns_elem_; }
    MemoryPlan::Slot s_stack_ = -1, s_ns_ = -1, s_ns_norms_ = -1, s_problems_ = -1;
    float *stack_ = nullptr, *ns_norms_ = nullptr;
    void* ns_ = nullptr;
    cuda::MuonDeviceProblem* problems_ = nullptr;
    float* sched_ = nullptr;  // [lr, 1 - beta1^t, 1 - beta2^t] of the staged step
    int32_t* skip_ = nullptr;
    const int32_t* veto_ = nullptr;
    std::vector<float*> m_, v_, mom_;
};

}  // namespace sparsetron::cuda
