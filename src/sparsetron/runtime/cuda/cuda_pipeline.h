// Pipeline parallelism on CUDA (SPEC §10): the pipeline timetable (runtime/pipeline_timetable.h,
// Megatron's 1F1B or, with several chunks per rank, its interleaved form) over the rank's stages
// of the GPU model, every transfer a device send/recv on the step's stream (NCCL between
// processes), so a step enqueues without a host synchronization and a captured graph can hold it.
// After each tick the forward message goes to the next rank and the input gradient to the
// previous one, as on the CPU backend.
//
// Memory: the device plan holds one micro-batch's activations per chunk. Instead of a copy of
// them per micro-batch in flight, a rank keeps each in-flight micro-batch's forward message (a
// chunk's input rows) and runs the chunk's forward again right before its backward when other
// work ran in between: Megatron's full recompute at the stage boundary, one more forward per
// micro-batch and chunk but where the backward follows its forward at once (the last stage), for
// a few messages of [tokens, hidden] bf16 instead of as many activation plans.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "sparsetron/config/run_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/cuda/glm5_model.h"
#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/runtime/pipeline_timetable.h"

namespace sparsetron {

// A rank's transfer buffers in `plan` (Activations): forward messages (a chunk's input rows from
// the stage before, kept until the chunk's backward) and output gradients (from the stage after,
// kept until the backward), as many slots of each as the timetable holds at once for up to
// `max_microbatches` micro-batches a step. The engine's pipeline and `sparsetron plan` plan them
// alike.
struct PipelineBuffers {
    int64_t row_bytes = 0, forward_slots = 0, grad_slots = 0;
    MemoryPlan::Slot forward = -1, grad = -1;
};
PipelineBuffers plan_pipeline_buffers(const cuda::CudaGlm5Model& model, MemoryPlan& plan,
                                      int64_t max_microbatches);
// The most micro-batches a step of `run` hands a stage: microbatches_per_step, or under dynamic
// CP, where a rank runs as many micro-batches as the step's schedule gives it groups, no bound.
int64_t pipeline_step_bound(const RunConfig& run);

// A step's micro-batches fed from the host one at a time instead of staged on the device: under
// dynamic CP each is packed for its own CP group, and their number varies by step.
struct PipelineHostFeed {
    // Micro-batch i's input block into the model (its CP group set first).
    std::function<void(int64_t i)> load;
    // A chunk's forward of micro-batch i is enqueued: its loss sums are in model.sums().
    std::function<void(int64_t i)> forwarded;
};

class CudaPipeline {
  public:
    // `pp`: one rank per pipeline rank, in order (device transfers); the model holds this rank's
    // stages (config/pipeline_split.h: pipeline_rank_stages). Plans the rank's message buffers
    // for up to `max_microbatches` per step.
    CudaPipeline(cuda::CudaGlm5Model& model, Comm& pp, MemoryPlan& plan, int64_t max_microbatches);
    void bind(const MemoryPlan& plan);

    // Enqueues `n` micro-batches through this rank's stages: input block i at inputs + i *
    // model.input_words() (device), the loss sums of its chunk c (this rank's layers' share:
    // model.n_sums() doubles) copied to sums + (i * chunks() + c) * model.n_sums() after the
    // chunk's forward. With scales.backward the 1F1B schedule, `before_last_backward` called
    // right before the rank's last backward is enqueued (the gradient reduction's hooks);
    // forward only otherwise.
    void enqueue(const ExecContext& ctx, const LossScales& scales, int64_t n, const int32_t* inputs,
                 double* sums, const std::function<void()>& before_last_backward = {});
    // The same schedule with the micro-batches fed by `feed` (eager: it uploads and reads;
    // `forwarded` is called after each chunk's forward).
    void enqueue(const ExecContext& ctx, const LossScales& scales, int64_t n,
                 const PipelineHostFeed& feed,
                 const std::function<void()>& before_last_backward = {});
    // Forwards run again by the last enqueue (host count: the schedule is static).
    int64_t recomputed() const { return recomputed_; }

    int rank() const { return rank_; }
    int ranks() const { return ranks_; }
    int chunks() const { return chunks_; }

  private:
    const PipelineTimetable& timetable(int64_t n, bool backward);
    void schedule(const ExecContext& ctx, const LossScales& sc, int64_t n, const int32_t* inputs,
                  double* sums, const std::function<void()>& before_last_backward);
    // `kept`: this forward's backward follows it at once (model.enqueue_forward).
    void forward(const ExecContext& ctx, const LossScales& sc, const PipelineTimetable& tt,
                 const PipelineWork& w, const int32_t* inputs, double* sums, bool kept);
    void backward(const ExecContext& ctx, const LossScales& sc, const PipelineTimetable& tt,
                  const PipelineWork& w, const int32_t* inputs);
    // Micro-batch i's inputs into the model (unless they are there).
    void load(const ExecContext& ctx, int64_t i, const int32_t* inputs);
    // One ring shift after tick t: forward messages to the next rank, or gradients to the
    // previous one (this rank's work `w` sends; a neighbour's may arrive).
    void shift(const ExecContext& ctx, const PipelineTimetable& tt, int64_t t,
               const PipelineWork* w, bool forward);
    // The message work (backward, micro-batch, chunk) reads: its slot's buffer.
    char* message(bool grad, int64_t micro_batch, int chunk) const;
    void release(bool grad, int64_t micro_batch, int chunk);

    const PipelineHostFeed* feed_ = nullptr;  // the enqueue's feed, if from the host
    cuda::CudaGlm5Model& model_;
    Comm& pp_;
    int rank_, ranks_, chunks_;
    PipelineBuffers buf_;
    char *forward_ = nullptr, *grad_ = nullptr;  // the slots, row_bytes apart
    std::map<std::pair<int64_t, bool>, std::unique_ptr<PipelineTimetable>> timetables_;
    // During an enqueue: the slot of each held message by (grad, micro-batch, chunk); free slots.
    std::map<std::tuple<bool, int64_t, int>, int64_t> held_;
    std::vector<int64_t> free_forward_, free_grad_;
    // The chunk and micro-batch whose activations the model holds for a backward that follows.
    std::pair<int, int64_t> resident_{-1, -1};
    int64_t loaded_ = -1;  // the micro-batch whose inputs the model holds
    int64_t recomputed_ = 0;
};

}  // namespace sparsetron
