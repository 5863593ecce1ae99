// The trainer: the training loop. It packs each step's micro-batches, sets their loss scales,
// hands the step to the backend's engine (step_engine.h), sums the losses over the ranks into the
// step's metrics, validates, saves and resumes checkpoints, and stops on a signal or a limit.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sparsetron/config/recipe.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/data/document_stream.h"
#include "sparsetron/data/packer.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/run_lock.h"
#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/parallel/context/dynamic_cp_batches.h"
#include "sparsetron/parallel/layout/process_groups.h"
#include "sparsetron/runtime/step_engine.h"
#include "sparsetron/runtime/step_metrics.h"
#include "sparsetron/runtime/training_plan.h"

namespace sparsetron {

struct TrainOptions {
    std::string out_dir;     // metrics.jsonl and (unless the recipe's `save` is set) checkpoints
    std::string resume_dir;  // checkpoint or save directory; "" = start fresh
    Device device = Device::CPU;
    bool save_checkpoints = true;  // false: no checkpoint at save_interval or at the end
    // Every process of the launch (MPI ranks on CPU, NCCL on GPUs); rank 0 writes checkpoints.
    // Null or one rank: a single process.
    Comm* comm = nullptr;
};

class Trainer {
  public:
    Trainer(Recipe recipe, TrainOptions options);
    ~Trainer();

    // Runs until train_iters, calling `on_step` after every step.
    // Why run() returned: train_iters reached, or a stop (a signal, exit_interval,
    // exit_duration_in_mins) after which the run saved a checkpoint (unless saving is off).
    struct End {
        enum Kind { Finished, Signal, ExitInterval, ExitDuration } kind = Finished;
        int signal = 0;  // Signal: its number (the process exits with 128 + it)
    };
    End run(const std::function<void(const StepMetrics&)>& on_step = {});
    StepMetrics train_step();
    // The validation loss over eval_iters steps' worth of micro-batches of the valid part,
    // forward only, the same documents every time (the valid stream restarts); nullopt when the
    // split gives the valid part no documents or eval_iters is 0.
    std::optional<StepMetrics::Valid> validate();
    std::string save();  // returns the checkpoint directory

    int64_t iteration() const { return state_.iteration; }
    const Recipe& recipe() const { return recipe_; }
    // The host plan: a CPU run's whole step, a CUDA run's host mirror (parameters, optimizer
    // state).
    const MemoryPlan& plan() const { return tp_->plan; }
    const ParamStore& params() const { return *tp_->params; }
    // The part of the model this rank holds (pipeline parallelism; the whole model otherwise).
    // The pipeline stages this rank holds (one, or its chunks under interleaving).
    const std::vector<PipelineStage>& stages() const { return stages_; }
    // A run started from pretrained weights: where they came from and the parameters left at
    // their initialization (the MTP layer, when the checkpoint has none); empty otherwise.
    const std::string& pretrained_from() const { return pretrained_from_; }
    const std::vector<std::string>& initialized_parameters() const { return initialized_; }
    // Device memory in use on CUDA, the planned host memory on CPU.
    double memory_gib() const { return engine_->memory_in_use_gib(); }
    // The engine's benchmark hooks (perf/bench.h), where the backend has them (null on CPU).
    StepBench* bench() { return engine_->bench(); }
    // "cpu (N threads)" or the CUDA device and its planned memory.
    std::string device_description() const { return engine_->describe(); }
    std::string checkpoint_dir() const;
    // The micro-batches the next step will consume (does not advance the stream).
    std::vector<MicroBatch> peek_next_step_batches();

    // Every process of the job (pipeline stages x data x context parallel ranks).
    int world_rank() const { return options_.comm ? options_.comm->rank() : 0; }
    int world_size() const { return options_.comm ? options_.comm->size() : 1; }
    // The data-parallel rank and size proper: the ranks of one CP group (context_parallel_size
    // consecutive ranks of a stage) share their micro-batches.
    int data_parallel_rank() const { return stage_rank() / cp_size(); }
    int data_parallel_size() const { return stage_size() / cp_size(); }

  private:
    // The ranks holding the same layers (every rank without pipeline parallelism).
    Comm* stage_comm() const {
        return groups_ && groups_->stage ? groups_->stage.get() : options_.comm;
    }
    int stage_rank() const { return stage_comm() ? stage_comm()->rank() : 0; }
    int stage_size() const { return stage_comm() ? stage_comm()->size() : 1; }
    int cp_size() const { return static_cast<int>(recipe_.run.context_parallel_size); }
    Communicators communicators() const;
    void open_data();
    void load_or_initialize();
    void adopt_run_id();
    // The step's loss scales (SPEC §6) for the packed batches_ of `m`; `chain_rows`: the e2e_tv
    // chain's rows (0 without it), over which the acceptance length is a mean.
    LossScales step_scales(const StepMetrics& m, int64_t& chain_rows) const;
    // Whether the run stops after the step just taken (agreed over every rank).
    End stop_after_this_step(std::chrono::steady_clock::time_point start) const;

    Recipe recipe_;
    TrainOptions options_;
    std::vector<PipelineStage> stages_ = {PipelineStage{}};
    std::unique_ptr<DirectoryLock> lock_;       // rank 0: the output directory is this run's
    std::unique_ptr<DirectoryLock> save_lock_;  // rank 0: so is the save directory, when apart
    int64_t last_saved_ = -1;  // the iteration of the run's newest checkpoint (-1: none yet)
    std::unique_ptr<TrainingPlan> tp_;
    std::unique_ptr<DocumentStream> stream_;
    std::unique_ptr<Packer> packer_;
    std::unique_ptr<DocumentStream> valid_stream_;  // the split's valid part (null: none)
    std::unique_ptr<Packer> valid_packer_;
    std::vector<MicroBatch> batches_;
    std::unique_ptr<DynamicCpBatches> dynamic_cp_;  // dynamic CP: this rank's groups
    TrainerState state_;
    std::unique_ptr<ProcessGroups> groups_;  // expert, context and pipeline parallelism
    std::unique_ptr<StepEngine> engine_;
    std::string pretrained_from_;
    std::vector<std::string> initialized_;
    int64_t stash_redos_ = 0;   // steps the MoE paged stash overflowed and ran again eagerly
    int64_t budget_redos_ = 0;  // steps over the EP receive budget, run again eagerly
};

}  // namespace sparsetron
