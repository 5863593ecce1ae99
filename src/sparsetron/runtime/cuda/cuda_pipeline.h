// Pipeline parallelism on CUDA (SPEC §10): the CPU schedule's 1F1B (runtime/pipeline_schedule.h)
// over one stage of the GPU model, every transfer a device send/recv on the step's stream (NCCL
// between processes), so a step enqueues without a host synchronization and a captured graph
// can hold it.
//
// Memory: the device plan holds one micro-batch's activations. Instead of a copy of them per
// micro-batch in flight (up to S - s on stage s of S), a stage keeps each in-flight
// micro-batch's forward message (its input rows) and runs its forward again right before its
// backward when other forwards ran in between: Megatron's full recompute at the stage boundary,
// one more forward per micro-batch on every stage but the last, for S - s messages of
// [tokens, hidden] bf16 instead of S - s activation plans.
#pragma once

#include <functional>

#include "sparsetron/config/run_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/cuda/glm5_model.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

// A stage's transfer buffers in `plan` (Activations): the ring of forward messages received
// (not on the first stage), the message sent and the output gradient received (not on the
// last). The engine's pipeline and `sparsetron plan` plan them alike.
struct PipelineBuffers {
    int64_t row_bytes = 0, message_bytes = 0, ring_slots = 0;
    MemoryPlan::Slot ring = -1, send = -1, grad = -1;
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
    // Micro-batch i's forward is enqueued: its loss sums are in model.sums().
    std::function<void(int64_t i)> forwarded;
};

class CudaPipeline {
  public:
    // `pp`: one rank per stage, in stage order (device transfers). Plans the stage's message
    // buffers for up to `max_microbatches` per step.
    CudaPipeline(cuda::CudaGlm5Model& model, Comm& pp, MemoryPlan& plan, int64_t max_microbatches);
    void bind(const MemoryPlan& plan);

    // Enqueues `n` micro-batches through this stage: input block i at inputs + i *
    // model.input_words() (device), its loss sums (this stage's: model.n_sums() doubles) copied
    // to sums + i * model.n_sums() after its forward. With scales.backward the 1F1B schedule,
    // `before_last_backward` called right before the last micro-batch's backward is enqueued
    // (the gradient reduction's hooks); forward only otherwise.
    void enqueue(const ExecContext& ctx, const LossScales& scales, int64_t n, const int32_t* inputs,
                 double* sums, const std::function<void()>& before_last_backward = {});
    // The same schedule with the micro-batches fed by `feed` (eager: it uploads and reads).
    void enqueue(const ExecContext& ctx, const LossScales& scales, int64_t n,
                 const PipelineHostFeed& feed,
                 const std::function<void()>& before_last_backward = {});
    // Forwards run again by the last enqueue (host count: the schedule is static).
    int64_t recomputed() const { return recomputed_; }

    int stage() const { return stage_; }
    int stages() const { return stages_; }

  private:
    // `kept`: micro-batch i's backward follows this forward (model.enqueue_forward).
    void forward(const ExecContext& ctx, const LossScales& sc, int64_t i, const int32_t* inputs,
                 double* sums, bool kept);
    void backward(const ExecContext& ctx, const LossScales& sc, int64_t i, const int32_t* inputs);
    // Micro-batch i's inputs (and on a later stage its message) into the model.
    void load(const ExecContext& ctx, int64_t i, const int32_t* inputs);
    void schedule(const ExecContext& ctx, const LossScales& sc, int64_t n, const int32_t* inputs,
                  double* sums, const std::function<void()>& before_last_backward);
    const PipelineHostFeed* feed_ = nullptr;  // the enqueue's feed, if from the host
    // One transfer with the next and/or the previous stage (absent neighbours are skipped).
    void exchange(const ExecContext& ctx, bool send_fwd, bool recv_bwd, bool send_bwd,
                  bool recv_fwd);
    char* ring(int64_t i) const { return ring_ + (i % buf_.ring_slots) * buf_.message_bytes; }

    cuda::CudaGlm5Model& model_;
    Comm& pp_;
    int stage_, stages_;
    bool first_, last_;
    PipelineBuffers buf_;
    char *ring_ = nullptr, *send_ = nullptr;  // forward messages in (one per slot) and out
    char* grad_in_ = nullptr;                 // d output, from the next stage
    int64_t resident_ = -1;                   // whose activations the model holds (-1: none)
    int64_t received_ = 0, recomputed_ = 0;
};

}  // namespace sparsetron
