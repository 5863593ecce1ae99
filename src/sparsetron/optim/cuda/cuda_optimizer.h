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
#include "sparsetron/optim/owner_assignment.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron::cuda {

class CudaOptimizer {
  public:
    // With a sharded `shard` (the distributed optimizer over the ranks holding the same
    // parameters, `distributed` their device communicator; null when only planning), each
    // parameter's AdamW moments or Muon momentum, its update and Newton-Schulz live on its owner
    // alone, which broadcasts the new weights (bf16, the fp32 master where every rank keeps one,
    // or the FP8 copy with fp8_param_gather); the model holds no master of another rank's
    // parameter (CudaGlm5Model).
    // With `expert_parallel` (more than one rank: the routed experts are sharded), each rank
    // updates its own experts (state kept here, never broadcast) and their squared gradient
    // norms are summed over the group.
    // With `pipeline` (one rank per stage, more than one stage): the clipping norms are summed
    // over the stages; a pipeline copy (the last stage's embedding) counts on the first stage
    // only, and is updated on both from the same summed gradient.
    CudaOptimizer(const CudaParams& P, MemoryPlan& plan, const ModelConfig& m, const RunConfig& r,
                  const OptimizerShard& shard = {}, Comm* distributed = nullptr,
                  Comm* expert_parallel = nullptr, Comm* pipeline = nullptr);
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
    // (the MoE stash's overflow flag, the expert exchange's over-budget flag).
    void add_veto(const int32_t* flag) { vetoes_.push_back(flag); }
    // Distributed with fp8_param_gather: the FP8 copies of the linears gathered in FP8
    // (CudaParam::fp8) quantized by their owners from the masters just loaded and broadcast
    // (after an upload; each step's update does the same for what it changed).
    void gather_fp8_copies(const ExecContext& ctx);
    // Device state tensors by checkpoint name ("<param>.exp_avg", ...); distributed: this rank's.
    std::vector<std::pair<std::string, MemoryPlan::Slot>> state_tensors() const;

  private:
    void plan_muon(MemoryPlan& plan, const RunConfig& r, int64_t max_numel);
    void bind_muon(const MemoryPlan& plan);
    // Newton-Schulz and the update of every Muon matrix of this rank, batch by batch (the
    // momentum updated in the gather).
    void run_muon_batches(const ExecContext& ctx, const RunConfig& run);
    // Distributed: this rank's updated parameters (the Muon matrices, or the others) to the
    // other ranks, and theirs to this one, on `ctx`'s stream.
    void broadcast_from_owners(const ExecContext& ctx, bool muon);
    // Parameter i's FP8 copy quantized by its owner and broadcast to the others.
    void send_fp8_copy(const ExecContext& ctx, size_t i);
    // A parameter whose gradient the clipping norm counts.
    static bool normed(const ParamInfo& p) { return p.trainable && !p.pipeline_copy; }
    const CudaParams& P_;
    const ModelConfig& cfg_;
    OptimizerShard shard_;
    Comm* dist_ = nullptr;
    Comm* ep_ = nullptr;
    Comm* pp_ = nullptr;
    MemoryPlan::Slot s_stage_sums_ = -1;
    float* stage_sums_ = nullptr;  // pipeline: [main, MTP] sums of squares, over the stages
    std::vector<bool> local_;      // a sharded routed expert's weight: this rank's alone
    std::vector<bool> updated_;    // a parameter the step updates (on some rank)
    std::vector<bool> mine_;       // a parameter this rank updates (and keeps state of)
    bool muon_ = false, separate_mtp_ = false;
    std::vector<bool> uses_muon_;
    std::vector<MemoryPlan::Slot> m_slots_, v_slots_, mom_slots_;
    std::vector<MuonSplit> splits_;
    std::vector<int64_t> part_off_;  // first partial-sum block of each parameter
    int64_t parts_main_ = 0, parts_total_ = 0;
    std::array<std::pair<int64_t, int64_t>, 2> expert_parts_{};  // per group: (first, count)
    MemoryPlan::Slot s_parts_, s_norm_, s_scale_, s_skip_, s_sched_;
    float *parts_ = nullptr, *norm_ = nullptr, *scale_ = nullptr;
    // Muon: this rank's Newton-Schulz batches, their workspace and the device table of their
    // problems.
    std::vector<MuonBatch> batches_;
    std::vector<int64_t> batch_first_;        // each batch's first row in the problem table
    int64_t ns_stack_ = 0;                    // elements of the largest batch
    std::unique_ptr<cuda::SideStream> side_;  // distributed: the AdamW parameters' broadcasts
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
    std::vector<const int32_t*> vetoes_;
    std::vector<float*> m_, v_, mom_;
};

}  // namespace sparsetron::cuda
