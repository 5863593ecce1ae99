// The host side of a training run, planned from its recipe: the parameter table and the host
// memory plan (a CPU run's whole step; a CUDA run's host mirror of the parameters and optimizer
// state, which checkpoints save and load), the optimizer, and on CPU the model. `sparsetron plan`
// prints it; the engines bind it.
#pragma once

#include <memory>
#include <vector>

#include "sparsetron/config/pipeline_stage.h"
#include "sparsetron/config/recipe.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/optim/optimizer.h"
#include "sparsetron/parallel/context/cp_row_plan.h"

namespace sparsetron {

struct TrainingPlan {
    ModelConfig model;  // the recipe's, as planned (expert-parallel ranks, dense warm-up top-k)
    MemoryPlan plan;
    std::unique_ptr<ParamStore> params;
    // CPU runs only: the model of each pipeline stage the rank holds (one without interleaving),
    // all binding `params` and planned in `plan`.
    std::vector<std::unique_ptr<Glm5Model<float>>> cpu_models;
    std::unique_ptr<Optimizer> optimizer;
    int64_t max_documents = 0;  // of the packed micro-batches
    int64_t chunk_rows = 0;
    CpRowPlan rows;  // the rows a rank's model computes and reads under context parallelism
    // Dynamic CP: a group's micro-batch holds world x max_seqlen_per_dp_cp_rank slots and up to
    // group_max_documents documents (0 without dynamic CP).
    int64_t group_slots = 0, group_max_documents = 0;
};

// The plan of a run of `recipe` on `device` (the CPU models only for Device::CPU). `stage`: the
// part of the model a pipeline stage holds (the whole model by default); `stages`: the stages a
// pipeline rank holds under interleaving.
std::unique_ptr<TrainingPlan> make_training_plan(const Recipe& recipe, Device device,
                                                 const PipelineStage& stage = {});
std::unique_ptr<TrainingPlan> make_training_plan(const Recipe& recipe, Device device,
                                                 const std::vector<PipelineStage>& stages);

// Stops, naming what to change, when the recipe's FP8 settings cannot run as written on
// `device` (an unimplemented recipe or format, the FP8 head on CPU): no run trains in higher
// precision silently under an FP8 recipe. The trainer and the bench call it.
void check_fp8_recipe(const RunConfig& run, Device device, bool fp8_output_proj = false);

}  // namespace sparsetron
