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
    EXPECT_EQ(cuda->cpu_model, nullptr);
    // The host mirror: parameters and optimizer state, no activations or workspace.
    EXPECT_GT(cuda->plan.class_bytes(MemClass::Parameters), 0u);
    EXPECT_GT(cuda->plan.class_bytes(MemClass::OptimizerState), 0u);
    EXPECT_EQ(cuda->plan.class_bytes(MemClass::Activations), 0u);
    EXPECT_EQ(cuda->plan.class_bytes(MemClass::Workspace), 0u);
    auto cpu = make_training_plan(r, Device::CPU);
    EXPECT_EQ(Glm5Model<float>::constructed(), before + 1);
    ASSERT_NE(cpu->cpu_model, nullptr);
    EXPECT_EQ(&cpu->cpu_model->params(), cpu->params.get()) << "the CPU model binds the table";
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

// A pipeline stage's table holds its own layers' parameters and, on the last stage with MTP, a
// copy of the embedding; the stages' tables together are the whole model's.
TEST(TrainingPlan, StageTablesPartitionTheModel) {
    Recipe r = load_recipe("", {"num_layers=4", "moe_layer_freq=[0,1,1,1]", "world_size=2",
                                "pipeline_model_parallel_size=2"});
    MemoryPlan whole_plan;
    const auto whole = make_param_table(r.model, whole_plan, DType::F32);
    std::map<std::string, int> seen;
    for (int s = 0; s < 2; ++s) {
        MemoryPlan plan;
        const PipelineStage stage = pipeline_stage(r.model, r.run, s);
        const auto table = make_param_table(r.model, plan, DType::F32, stage);
        for (const ParamInfo& p : table->params()) {
            ASSERT_GE(whole->index_of(p.name), 0) << p.name;
            EXPECT_EQ(p.shape, whole->at(p.name).shape);
            EXPECT_EQ(p.pipeline_copy, s == 1 && p.name == "model.embed_tokens.weight") << p.name;
            if (!p.pipeline_copy) ++seen[p.name];
        }
    }
    for (const ParamInfo& p : whole->params()) EXPECT_EQ(seen[p.name], 1) << p.name;
    EXPECT_EQ(seen.size(), whole->params().size());
}
