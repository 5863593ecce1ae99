// The trainer: packs micro-batches, runs forward/backward with gradient accumulation, clips,
// steps the optimizer, logs metrics, and saves/resumes checkpoints.
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
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/optim/optimizer.h"
#include "sparsetron/parallel/comm.h"
#include "sparsetron/parallel/process_groups.h"
#include "sparsetron/runtime/device_engine.h"
#include "sparsetron/runtime/grad_ranges.h"
#include "sparsetron/runtime/pipeline_schedule.h"

namespace sparsetron {

struct StepMetrics {
    int64_t step = 0;
    double lm_loss = 0;
    double mtp_loss = 0;      // λ-scaled, as it enters total_loss (0 without MTP)
    double indexer_loss = 0;  // Σ over DSA layers of coeff * mean KL, averaged over micro-batches
    double aux_loss = 0;      // MoE sequence aux loss (0 when off)
    double total_loss = 0;
    double mtp_acceptance_length = 0;            // e2e_tv: mean Σ_j Π_{k<=j} α_k over chain rows
    std::vector<std::vector<int64_t>> moe_load;  // per MoE layer: tokens per expert in the step
    int64_t moe_dropped = 0;                     // routed rows over capacity in the step
    int64_t moe_stash_pages = 0;       // MoE paged stash: pool pages (0 without the stash)
    int64_t moe_stash_peak_pages = 0;  // most pages in use at once in the step
    // The stash overflowed and the step ran again eagerly without it; moe_stash_redos counts
    // such steps since the run (or its resume) began.
    bool moe_stash_redo = false;
    int64_t moe_stash_redos = 0;
    double lr = 0;
    double grad_norm = 0;
    double grad_norm_mtp = 0;  // the MTP clipping group's norm (detached heads), else 0
    int64_t tokens = 0;        // real tokens in the step
    int64_t targets = 0;       // loss rows in the step
    double step_ms = 0;
    bool skipped = false;
    bool graph = false;  // the step ran as a CUDA graph replay (cuda_graph_impl full_iteration)
    // Dynamic CP: groups the step ran, by CP size (entry i: size 2^i), and the ranks left
    // without a group, summed over the step's scheduled micro-batches.
    std::vector<int64_t> dynamic_cp_groups;
    int64_t dynamic_cp_idle_ranks = 0;
    // Validation after this step (eval_interval): set when it ran.
    struct Valid {
        double lm_loss = 0;
        double mtp_loss = 0;  // λ-scaled like mtp_loss (0 without MTP)
        int64_t targets = 0;  // LM target rows it averaged over
        int64_t micro_batches = 0;
    };
    std::optional<Valid> valid;
    std::string to_json() const;
};

struct TrainOptions {
    std::string out_dir;     // metrics.jsonl and (unless the recipe's `save` is set) checkpoints
    std::string resume_dir;  // checkpoint or save directory; "" = start fresh
    Device device = Device::CPU;
    bool save_checkpoints = true;  // false: no checkpoint at save_interval or at the end
    // Data parallelism over these ranks (CPU): rank r runs micro-batches r, r + W, ... of every
    // step, gradients and losses are summed over ranks, rank 0 writes checkpoints. Null or one
    // rank: a single process.
    Comm* comm = nullptr;
};

// Memory plan of a training run of `recipe` (parameters, gradients, optimizer state, activations,
// workspace). Used by the trainer and by `sparsetron plan`.
struct TrainingPlan {
    MemoryPlan plan;
    std::unique_ptr<Glm5Model<float>> model;
    std::unique_ptr<Optimizer> optimizer;
    int64_t max_documents = 0;  // of the packed micro-batches
    int64_t chunk_rows = 0;
    // Dynamic CP: a group's micro-batch holds world x max_seqlen_per_dp_cp_rank slots and up to
    // group_max_documents documents (0 without dynamic CP).
    int64_t group_slots = 0, group_max_documents = 0;
};
// `stage`: the part of the model a pipeline stage holds (the whole model by default).
std::unique_ptr<TrainingPlan> make_training_plan(const Recipe& recipe,
                                                 const PipelineStage& stage = {});

// Stops, naming what to change, when the recipe's FP8 settings cannot run as written on
// `device` (an unimplemented recipe or format, FP8 on CPU): no run trains bf16 silently under
// an FP8 recipe. The trainer and the bench call it.
void check_fp8_recipe(const RunConfig& run, Device device);

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
    const MemoryPlan& plan() const { return tp_->plan; }
    // The model's parameter table (on CUDA runs the CPU model only plans the host mirror).
    const ParamStore& params() const { return tp_->model->params(); }
    Glm5Model<float>& model() { return *tp_->model; }
    // A run started from pretrained weights: where they came from and the parameters left at
    // their initialization (the MTP layer, when the checkpoint has none); empty otherwise.
    const std::string& pretrained_from() const { return pretrained_from_; }
    const std::vector<std::string>& initialized_parameters() const { return initialized_; }
    // Device memory in use on CUDA, the planned host memory on CPU.
    double memory_gib() const;
    // "cpu (N threads)" or the CUDA device and its planned memory.
    std::string device_description() const;
    std::string checkpoint_dir() const;
    // The micro-batches the next step will consume (does not advance the stream).
    std::vector<MicroBatch> peek_next_step_batches();

    // Every process of the job (pipeline stages x data x context parallel ranks).
    int world_rank() const { return options_.comm ? options_.comm->rank() : 0; }
    int world_size() const { return options_.comm ? options_.comm->size() : 1; }
    // The ranks holding the same layers (every rank without pipeline parallelism).
    Comm* stage_comm() const {
        return groups_ && groups_->stage ? groups_->stage.get() : options_.comm;
    }
    int stage_rank() const { return stage_comm() ? stage_comm()->rank() : 0; }
    int stage_size() const { return stage_comm() ? stage_comm()->size() : 1; }
    // The data-parallel rank and size proper: the ranks of one CP group (context_parallel_size
    // consecutive ranks of a stage) share their micro-batches.
    int data_parallel_rank() const { return stage_rank() / cp_size(); }
    int data_parallel_size() const { return stage_size() / cp_size(); }
    int cp_size() const { return static_cast<int>(recipe_.run.context_parallel_size); }
    // Distributed optimizer: the rank that updates each parameter (-1: not trained;
    // kLocalOwner: a routed expert sharded over EP, which every rank updates itself); empty
    // without one.
    static constexpr int kLocalOwner = -2;
    const std::vector<int>& parameter_owners() const { return owner_; }

  private:
    // Whether the run stops after the step just taken (agreed over every rank).
    End stop_after_this_step(std::chrono::steady_clock::time_point start) const;
    void next_step_batches(std::vector<MicroBatch>& out);
    // Dynamic CP: this rank's groups of the step's schedule (the documents of `batches_`), each
    // packed into a micro-batch, with its CP communicator in `cps` (null: a group of one rank);
    // counts every rank's groups by size into `m`.
    std::vector<const MicroBatch*> dynamic_cp_batches(std::vector<Comm*>& cps, StepMetrics& m);
    void assign_owners();
    // The routing statistics summed over the ranks holding each MoE layer; under pipeline
    // parallelism every stage's layers in the metrics (m.moe_load, m.moe_dropped).
    void reduce_moe_stats(StepMetrics& m);
    // Pipeline parallelism with MTP: the first stage's embedding gradient and the last stage's
    // copy's, summed (both then take the same update).
    void reduce_shared_embedding();
    // Pipeline parallelism on CUDA: the step's MoE metrics (loads, dropped rows) of every stage.
    void gather_stage_moe_metrics(StepMetrics& m);
    // Parameters (state: the optimizer state tensors instead) from their owners to every rank.
    void broadcast_from_owners(bool state);

    Recipe recipe_;
    TrainOptions options_;
    std::unique_ptr<DirectoryLock> lock_;  // rank 0: the output directory is this run's
    std::vector<int64_t> saved_;           // iterations this run saved (what retention may delete)
    std::unique_ptr<TrainingPlan> tp_;
    std::unique_ptr<DocumentStream> stream_;
    std::unique_ptr<Packer> packer_;
    std::unique_ptr<DocumentStream> valid_stream_;  // the split's valid part (null: none)
    std::unique_ptr<Packer> valid_packer_;
    std::vector<MicroBatch> batches_;
    std::vector<std::unique_ptr<MicroBatch>> group_batches_;  // dynamic CP: this rank's groups
    std::vector<bool> indexer_only_;                          // parameters dense warm-up updates
    TrainerState state_;
    std::unique_ptr<DeviceEngine> engine_;        // set for --device cuda
    std::unique_ptr<ProcessGroups> groups_;       // expert, context and pipeline parallelism
    std::unique_ptr<PipelineSchedule> pipeline_;  // pipeline parallelism (CPU)
    std::vector<int> owner_;              // distributed optimizer: owning rank per parameter
    std::vector<bool> owned_;             // ... and whether this rank owns it
    std::vector<GradRange> grad_ranges_;  // CPU data parallelism: what each reduction covers
    std::string pretrained_from_;
    std::vector<std::string> initialized_;
    int64_t stash_redos_ = 0;  // steps the MoE paged stash overflowed and ran again eagerly
};

// Where a run's weights come from when it does not resume: an HF directory or an engine
// checkpoint given by pretrained_checkpoint, by `load` with finetune, or by a `load` that is an
// HF directory; "" for a fresh initialization or a full resume.
std::string pretrained_weights_dir(const RunConfig& run, const std::string& resume_dir);
// Stops, naming the field and both values, when `dir`/config.json describes another model than
// `model` (the dimensions that shape the weights).
void check_pretrained_config(const std::string& dir, const ModelConfig& model);

// Resolves an empty data_path to the bundled corpus, preprocessed into `out_dir`/data once.
std::vector<std::string> resolve_data_path(const RunConfig& run, const std::string& out_dir);

}  // namespace sparsetron
