// StepEngine: what the Trainer drives to run a training step on one backend. The Trainer is the
// loop (data, loss scales, metrics, checkpoints, stop); an engine owns the backend's model, its
// optimizer and the step's collectives. Both engines read and write the host plan's parameters
// and optimizer state (TrainingPlan), which checkpoints save and load: the CPU engine computes on
// them directly, the CUDA engine mirrors them on the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsetron/config/recipe.h"
#include "sparsetron/data/packer.h"
#include "sparsetron/model/losses.h"
#include "sparsetron/optim/optimizer.h"
#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/runtime/training_plan.h"

namespace sparsetron {

// The communicators of a run's layout (null where the recipe has no such parallelism): every
// rank, the ranks holding the same layers (data-parallel ranks, with their CP and EP ranks), the
// expert-parallel group, the fixed context-parallel group, the ranks holding the same experts,
// one rank per pipeline stage, and the first and last stages' embedding pair.
struct Communicators {
    Comm* world = nullptr;
    Comm* stage = nullptr;
    Comm* expert = nullptr;
    Comm* context = nullptr;
    Comm* expert_data = nullptr;
    Comm* pipeline = nullptr;
    Comm* embedding = nullptr;
};

// One step's work, as the Trainer hands it over: this rank's micro-batches, their loss scales
// and the step number (the optimizer's schedule). Under dynamic context parallelism each
// micro-batch comes with its CP group (null: a group of this rank alone).
struct StepWork {
    std::vector<const MicroBatch*> micro_batches;
    std::vector<Comm*> cp_groups;  // dynamic CP only; empty otherwise
    LossScales scales;
    // The optimizer update this step makes, 1-based: 1 + the updates applied before it (skipped
    // steps do not count, as in Megatron, whose scheduler and Adam step only on an update). The
    // learning rate and AdamW's bias corrections follow it.
    int64_t update = 0;
};

// The MoE paged stash's use in a step (moe_paged_stash; pool_pages 0 when off). On overflow the
// step's update was skipped and the step ran again eagerly with the stash bypassed
// (StepOutcome::redone); these are the overflowed attempt's figures.
struct StashUse {
    int64_t pool_pages = 0, page_rows = 0, peak_pages = 0, demand_pages = 0;
    int64_t balanced_pages = 0;  // every application's rows on balanced routing (the factor's base)
    bool overflow = false;
};

// What a step did: each micro-batch's loss sums as this rank computed them (summed over ranks by
// the Trainer), the optimizer's statistics, and the routing statistics summed over every rank
// (every pipeline stage's MoE layers, in layer order). The router biases have been updated.
struct StepOutcome {
    std::vector<LossSums> losses;
    StepStats stats;
    std::vector<std::vector<int64_t>> moe_load;  // per backbone MoE layer: tokens per expert
    int64_t moe_dropped = 0;                     // routed rows over capacity, every application
    bool replayed = false;                       // the step ran as a CUDA graph replay
    StashUse stash;
    // The routing went over the expert-parallel receive budget (moe_expert_rank_capacity_factor)
    // on some rank: the update was skipped and the step ran again eagerly in token chunks.
    bool over_budget = false;
    bool redone = false;  // the stash or the budget overflowed: the outcome is the eager redo's
};

class StepBench;

class StepEngine {
  public:
    virtual ~StepEngine() = default;
    // The host plan's parameters and optimizer state to the engine (after initialization or a
    // checkpoint load), and back, gathered from their owners under a distributed optimizer, so
    // the ranks that write a checkpoint hold what it saves.
    virtual void upload_state() = 0;
    virtual void download_state() = 0;
    // A whole step: zeroed gradients, every micro-batch's forward and backward, the gradients
    // and routing statistics reduced over the ranks, the optimizer step and the router biases.
    virtual StepOutcome run_step(const StepWork& work) = 0;
    // Forward passes only (scales.backward false: validation); the losses as this rank computes
    // them (under pipeline parallelism its stage's share).
    virtual std::vector<LossSums> forward_only(const std::vector<const MicroBatch*>& micro_batches,
                                               const LossScales& scales) = 0;
    // One line: the device and its threads or planned memory.
    virtual std::string describe() const = 0;
    // Memory the step uses: the device's in use on CUDA, the planned host memory on CPU.
    virtual double memory_in_use_gib() const = 0;
    // The benchmark's hooks (perf/bench.h), where the backend has them (null otherwise).
    virtual StepBench* bench() { return nullptr; }
};

// How bench runs a step: eagerly, with chunk-wise graphs (cuda_graph_impl: local), or as one
// captured graph of the whole step (full_iteration).
enum class BenchMode { Eager, Local, Graph };

// What `sparsetron bench` times on an engine: a staged micro-batch run as whole steps.
class StepBench {
  public:
    virtual ~StepBench() = default;
    // Copies a micro-batch into the model's input buffers (`cp_group`: its CP communicator under
    // dynamic CP, null for a group of this rank alone).
    virtual void stage_inputs(const MicroBatch& mb, const LossScales& scales, Comm* cp_group) = 0;
    // Zeroed gradients, `micro_batches` forward+backward passes of the staged inputs, and with
    // `optimizer` the optimizer step for `step`; its device time from events. With
    // BenchMode::Graph the step is captured once (again when `optimizer` or `micro_batches`
    // change) and replayed; the graph bakes the optimizer's host scalars of the step it was
    // captured at, which leaves the work timed unchanged. With BenchMode::Local the model's
    // chunks are graphs (each captured on its second run). Losses are not read back.
    virtual double timed_step(BenchMode mode, bool optimizer, const LossScales& scales,
                              int64_t micro_batches, int64_t step) = 0;
    // The static plan's total with the expert exchange's buffers, MiB.
    virtual double planned_memory_mib() const = 0;
    // Training graphs captured so far, and the stage forwards recomputed before their backward
    // in the last step (pipeline parallelism): what tests of the engine check.
    virtual int64_t graph_captures() const = 0;
    virtual int64_t pipeline_recomputed() const = 0;
};

// The CPU engine: the CPU model on the host plan, the CPU optimizer, collectives over the
// communicators (MPI ranks), the pipeline schedule under pipeline parallelism.
std::unique_ptr<StepEngine> make_cpu_engine(const Recipe& recipe, TrainingPlan& plan,
                                            const Communicators& comms);
// The CUDA engine, mirroring the host plan's parameters and optimizer state on the device. With
// a stage group of more than one rank (NCCL), every step sums the gradients and routing
// statistics over it on the device (inside the captured graph with full_iteration); with the
// context group a rank computes its chunks of every document; with the pipeline group the engine
// holds this rank's stage and runs 1F1B. Throws "built without CUDA" in a CPU-only build.
std::unique_ptr<StepEngine> make_cuda_engine(const Recipe& recipe, TrainingPlan& plan,
                                             const Communicators& comms);

}  // namespace sparsetron
