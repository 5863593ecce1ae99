// The host side of a run: the parameter table is built once from the config, and a CUDA run's
// plan holds the host mirror (parameters, optimizer state) without a CPU model.
#include <gtest/gtest.h>

#include <map>

#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/model/param_table.h"
#include "sparsetron/runtime/training_plan.h"
#include "test_util.h"

using namespace sparsetron;

TEST(TrainingPlan, CudaRunBuildsNoCpuModel) {
    const Recipe r = builtin_tiny_recipe();
    const int64_t before = Glm5Model<float>::constructed();
    auto cuda = make_training_plan(r, Device::CUDA);
    EXPECT_EQ(Glm5Model<float>::constructed(), before) << "a CUDA run's plan built a CPU model";
    EXPECT_TRUE(cuda->cpu_models.empty());
    // The host mirror: parameters and optimizer state, no activations or workspace.
    EXPECT_GT(cuda->plan.class_bytes(MemClass::Parameters), 0u);
    EXPECT_GT(cuda->plan.class_bytes(MemClass::OptimizerState), 0u);
    EXPECT_EQ(cuda->plan.class_bytes(MemClass::Activations), 0u);
    EXPECT_EQ(cuda->plan.class_bytes(MemClass::Workspace), 0u);
    auto cpu = make_training_plan(r, Device::CPU);
    EXPECT_EQ(Glm5Model<float>::constructed(), before + 1);
    ASSERT_EQ(cpu->cpu_models.size(), 1u);
    EXPECT_EQ(&cpu->cpu_models.front()->params(), cpu->params.get())
        << "the CPU model binds the table";
    EXPECT_GT(cpu->plan.class_bytes(MemClass::Activations), 0u);
    // Both runs' tables: the same parameters, in the same order, with the same layout.
    const auto& a = cuda->params->params();
    const auto& b = cpu->params->params();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].name, b[i].name);
        EXPECT_EQ(a[i].shape, b[i].shape);
        EXPECT_EQ(cuda->plan.entries()[size_t(a[i].param_slot)].offset,
                  cpu->plan.entries()[size_t(b[i].param_slot)].offset)
            << a[i].name;
    }
}

namespace {

// A pipeline stage's table holds its own layers' parameters and, on the last stage with MTP, a
// copy of the embedding; the stages' tables together are the whole model's. Returns the whole
// model's table.
std::unique_ptr<ParamStore> expect_stages_partition_the_model(const Recipe& r,
                                                              MemoryPlan& whole_plan) {
    auto whole = make_param_table(r.model, whole_plan, DType::F32);
    const int stages = int(r.run.pipeline_model_parallel_size);
    std::map<std::string, int> seen;
    for (int s = 0; s < stages; ++s) {
        MemoryPlan plan;
        const PipelineStage stage = pipeline_stage(r.model, r.run, s);
        const auto table = make_param_table(r.model, plan, DType::F32, stage);
        for (const ParamInfo& p : table->params()) {
            EXPECT_GE(whole->index_of(p.name), 0) << p.name;
            if (whole->index_of(p.name) < 0) continue;
            EXPECT_EQ(p.shape, whole->at(p.name).shape);
            EXPECT_EQ(p.pipeline_copy, s == stages - 1 && p.name == "model.embed_tokens.weight")
                << p.name;
            if (!p.pipeline_copy) ++seen[p.name];
        }
    }
    for (const ParamInfo& p : whole->params()) EXPECT_EQ(seen[p.name], 1) << p.name;
    EXPECT_EQ(seen.size(), whole->params().size());
    return whole;
}

}  // namespace

TEST(TrainingPlan, StageTablesPartitionTheModel) {
    MemoryPlan plan;
    expect_stages_partition_the_model(
        load_recipe("", {"num_layers=4", "moe_layer_freq=[0,1,1,1]", "world_size=2",
                         "pipeline_model_parallel_size=2"}),
        plan);
}

// The 256-GPU recipe's four stages (18/20/20/20 at GLM-5.2's offset 3) hold the whole model's
// HF names once, the MTP layer with its own indexer (numbered inside its block, as Megatron and
// the released checkpoint have it) on the last: an HF checkpoint of the full model loads into
// the layout by name.
TEST(TrainingPlan, Seed256GpuStagesHoldTheWholeHfModel) {
    const std::string dir = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/";
    const Recipe r =
        load_recipe(dir + "glm5.2-256gpu.yaml," + dir + "overlays/cpu-tiny-width.yaml");
    ASSERT_EQ(r.run.pipeline_model_parallel_size, 4);
    MemoryPlan plan;
    const auto whole = expect_stages_partition_the_model(r, plan);
    for (int64_t layer : {0, 1, 2, 6, 74, 78})
        EXPECT_GE(whole->index_of(cat("model.layers.", layer, ".self_attn.indexer.wq_b.weight")), 0)
            << layer;
    for (int64_t layer : {3, 5, 75, 77})
        EXPECT_LT(whole->index_of(cat("model.layers.", layer, ".self_attn.indexer.wq_b.weight")), 0)
            << layer;
    EXPECT_GE(whole->index_of("model.layers.78.eh_proj.weight"), 0);
}
