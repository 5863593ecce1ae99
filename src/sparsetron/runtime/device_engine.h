// DeviceEngine: what the trainer drives when the step runs on an accelerator. The trainer keeps
// the data pipeline, loss normalization, metrics and checkpoints; the engine owns the device
// model, its optimizer and the device copies of parameters and optimizer state. The host plan
// (parameters and optimizer state only) mirrors them for checkpoints and initialization.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sparsetron/config/recipe.h"
#include "sparsetron/data/packer.h"
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/model/pipeline_stage.h"
#include "sparsetron/optim/optimizer.h"
#include "sparsetron/parallel/comm.h"

namespace sparsetron {

class DeviceEngine {
  public:
    virtual ~DeviceEngine() = default;
    // Host mirror -> device (after initialization or checkpoint load) and back (before a save).
    virtual void upload_state() = 0;
    virtual void download_state() = 0;
    // With the distributed optimizer: the rank holding each parameter's optimizer state (-1:
    // every rank holds it, or the parameter has none); empty when the state is not sharded.
    virtual std::vector<int> state_owners() const { return {}; }
    // Zero gradients and routing statistics.
    virtual void begin_step() = 0;
    virtual LossSums micro_batch(const MicroBatch& mb, const LossScales& scales) = 0;
    // A whole step of `micro_batches`: zeroed gradients and routing statistics, each micro-batch's
    // forward+backward, the optimizer step for `step`. With cuda_graph_impl full_iteration the
    // first step runs eagerly from the staging slots (warm-up: GEMM plans, kernel attributes),
    // later ones replay a CUDA graph of the same work captured once; a step with another
    // signature (micro-batch count, which losses have a backward) is captured again, with a line
    // on stderr. Each step's data, loss scales and learning rate are copied into device buffers
    // before the replay, so the graph never runs on stale values.
    // The MoE paged stash's use in a step (moe_paged_stash; pool_pages 0 when off). On
    // overflow the step's update was skipped on the device and the step ran again eagerly with
    // the stash bypassed (StepOutcome::redone); these are the overflowed attempt's figures.
    struct StashUse {
        int64_t pool_pages = 0, page_rows = 0, peak_pages = 0, demand_pages = 0;
        int64_t worst_case_pages = 0;  // every application at its bound (the factor's base)
        bool overflow = false;
    };
    struct StepOutcome {
        std::vector<LossSums> losses;  // per micro-batch, in order
        StepStats stats;
        bool replayed = false;  // the step ran as a graph replay
        StashUse stash;
        bool redone = false;  // the stash overflowed: the outcome is the eager redo's
    };
    // cp_groups (dynamic context parallelism only): each micro-batch's CP communicator (null: a
    // group of this rank alone).
    virtual StepOutcome run_step(const std::vector<const MicroBatch*>& micro_batches,
                                 const LossScales& scales, const RunConfig& run, int64_t step,
                                 const std::vector<Comm*>* cp_groups = nullptr) = 0;
    // How many times run_step captured a graph (0 without graphs).
    virtual int64_t graph_captures() const = 0;
    // Forward passes of `micro_batches` (scales.backward false: evaluation), their losses as this
    // rank computes them (under pipeline parallelism its stage's share).
    virtual std::vector<LossSums> forward_only(const std::vector<const MicroBatch*>& micro_batches,
                                               const LossScales& scales) {
        std::vector<LossSums> out;
        for (const MicroBatch* mb : micro_batches) out.push_back(micro_batch(*mb, scales));
        return out;
    }
    // Pipeline parallelism: the stage forwards the last step ran again before their backward.
    virtual int64_t pipeline_recomputed() const { return 0; }
    virtual std::vector<std::vector<int64_t>> moe_loads() = 0;
    virtual int64_t moe_dropped() = 0;
    virtual StepStats optimizer_step(const RunConfig& run, int64_t step) = 0;
    virtual void update_router_bias(double rate) = 0;
    // One line: device, planned device memory.
    virtual std::string describe() const = 0;

    // Benchmark support (`sparsetron bench`). stage_inputs() copies a micro-batch into the
    // model's input buffers; timed_step() then runs a whole step on them — zeroed gradients,
    // `micro_batches` forward+backward passes of the staged inputs, and with `optimizer` the
    // optimizer step for `step` — and returns its device time from CUDA events. With `graph` the
    // step is captured into a CUDA graph on first use (and again when `optimizer` or
    // `micro_batches` change) and replayed; the graph bakes the optimizer's host scalars of the
    // step it was captured at (learning rate, bias corrections), which leaves the work timed
    // unchanged. Losses are not read back.
    // `cp_group` (dynamic context parallelism only): the micro-batch's CP communicator, as in
    // run_step (null: a group of this rank alone).
    virtual void stage_inputs(const MicroBatch& mb, const LossScales& scales,
                              Comm* cp_group = nullptr) = 0;
    virtual double timed_step(bool graph, bool optimizer, const LossScales& scales,
                              int64_t micro_batches, const RunConfig& run, int64_t step) = 0;
    // Device memory in use (cudaMemGetInfo) and the static plan's total, MiB.
    virtual double memory_in_use_mib() const = 0;
    virtual double planned_memory_mib() const = 0;
};

// The CUDA engine for `recipe`, mirroring the host plan's parameters (`host_store`, `host_plan`)
// and optimizer state (`host_optimizer`). With `data_parallel` (a communicator with device
// collectives, NCCL, over more than one rank) every step sums the gradients and the routing
// statistics over its ranks on the device, after the micro-batches and before the optimizer
// (inside the captured graph with full_iteration). With `context_parallel` (the CP group, for
// context_parallel_size > 1) a rank computes its chunks of every document of its micro-batches.
// With `pipeline` (pipeline_model_parallel_size > 1: one rank per stage, device transfers) the
// engine holds this rank's stage (`host_store` is that stage's) and a step runs 1F1B over its
// micro-batches; `data_parallel` is then the stage's ranks and `embedding` the first and last
// stages' pair, which sums the embedding's gradient when MTP reads it on the last stage.
// Throws "built without CUDA" in a CPU-only build.
std::unique_ptr<DeviceEngine> make_cuda_engine(
    const Recipe& recipe, const ParamStore& host_store, const MemoryPlan& host_plan,
    const Optimizer& host_optimizer, int64_t max_documents, int64_t chunk_rows,
    Comm* data_parallel = nullptr, Comm* expert_parallel = nullptr,
    Comm* context_parallel = nullptr, Comm* expert_data_parallel = nullptr,
    Comm* pipeline = nullptr, Comm* embedding = nullptr);

// The device memory plan the CUDA engine would allocate for `recipe` (built without touching a
// GPU), unallocated. Throws "built without CUDA" in a CPU-only build.
// `stage`: pipeline parallelism, the stage `host_store` holds.
MemoryPlan cuda_memory_plan(const Recipe& recipe, const ParamStore& host_store,
                            int64_t max_documents, int64_t chunk_rows,
                            const PipelineStage& stage = {});

// Why a device plan of `planned` bytes cannot be allocated in `free_bytes`, and what would make it
// fit: the plan with every selective recompute module when the recipe does not use them all
// (its size, and whether it fits), else shorter micro-batches or more context-parallel ranks.
// Empty when it fits. Throws "built without CUDA" in a CPU-only build.
std::string cuda_plan_shortfall(const Recipe& recipe, const ParamStore& host_store,
                                int64_t max_documents, int64_t chunk_rows, size_t planned,
                                size_t free_bytes, const PipelineStage& stage = {});

// The same plan as the per-class table of MemoryPlan::format() (`top` buffers per class), with
// expert parallelism's exchange buffers added to the total; `stage`: one pipeline stage's
// (`host_store` that stage's parameters). Throws "built without CUDA" in a CPU-only build.
std::string format_cuda_plan(const Recipe& recipe, const ParamStore& host_store,
                             int64_t max_documents, int64_t chunk_rows, size_t* total_bytes,
                             int top = 6, const PipelineStage& stage = {});

}  // namespace sparsetron
