// The expert-parallel receive budget (moe_expert_rank_capacity_factor) on CUDA, two EP ranks as
// threads on one GPU (tests/gpu/thread_training.h) with the NCCL exchange's fixed blocks sized by
// the budget instead of the dropless bound. The tiny recipe routes 256 tokens x top-2 over 4
// experts: a source sends each owner about 256 rows, at most 512 (dropless).
// - factor 1.5 (blocks of 384 rows): no step goes over; the run is the one-GPU run;
// - factor 0.5 (128 rows): every step goes over on some rank; every rank's update is vetoed and
//   the step redone eagerly with the routed experts in 4 chunks of 64 tokens (whose dropless
//   rows fit the budget), so the losses, gradient norms and routing are still the one-GPU run's,
//   alone and with the paged stash (whose redo is the same), and with pipeline stages.
#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <vector>

#include "gpu/harness.h"

#if SPARSETRON_WITH_CUDA
#include "gpu/thread_training.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaExpertBudget, Skipped) {
    GTEST_SKIP() << "built without CUDA: GPU tests run on the GPU machine";
}
#else

TEST(CudaExpertBudget, StepsOverTheReceiveBudgetAreRedoneInChunksAndMatchOneGpu) {
    REQUIRE_GPU();
    const auto one =
        train(trainer_recipe(1, {}), {temp_dir("budget-one"), "", Device::CUDA, false, nullptr});
    ASSERT_EQ(one.size(), 4u);
    struct Case {
        std::string tag;
        std::vector<std::string> sets;
        bool redone;
    };
    const std::vector<Case> cases = {
        {"ep2-budget-1.5", {"moe_expert_rank_capacity_factor=1.5"}, false},
        {"ep2-budget-0.5", {"moe_expert_rank_capacity_factor=0.5"}, true},
        {"ep2-budget-0.5-stash",
         {"moe_expert_rank_capacity_factor=0.5", "moe_paged_stash=true"},
         true},
    };
    for (const Case& c : cases) {
        std::vector<std::string> sets = {"expert_model_parallel_size=2",
                                         "moe_expert_exchange=nccl"};
        sets.insert(sets.end(), c.sets.begin(), c.sets.end());
        const auto ranks = train_threads(2, trainer_recipe(2, sets), c.tag);
        expect_metrics_match(c.tag, one, ranks, 1e-5, true);
        for (size_t r = 0; r < ranks.size(); ++r) {
            ASSERT_EQ(ranks[r].size(), one.size()) << c.tag;
            for (size_t i = 0; i < ranks[r].size(); ++i) {
                EXPECT_EQ(ranks[r][i].moe_budget_redo, c.redone)
                    << c.tag << " rank " << r << " step " << i + 1;
                EXPECT_FALSE(ranks[r][i].skipped) << c.tag << ": the redo's update ran";
            }
            EXPECT_EQ(ranks[r].back().moe_budget_redos, c.redone ? 4 : 0) << c.tag;
        }
    }
}

// With two pipeline stages (PP 2 x EP 2, four threads): the first stage holds the dense layer,
// the second the MoE layer and the MTP layer, so only the second goes over the budget; the flag
// is a maximum over the world, so the first stage's update is vetoed too and both stages redo
// the step (and the validation passes) eagerly. The losses are still the one-GPU run's.
TEST(CudaExpertBudget, AStageOverTheBudgetRedoesTheStepOnEveryStage) {
    REQUIRE_GPU();
    const std::vector<std::string> model = {"dsa_indexer_skip_topk_offset=2"};
    const auto one = train(trainer_recipe(1, model),
                           {temp_dir("pp-budget-one"), "", Device::CUDA, false, nullptr});
    ASSERT_EQ(one.size(), 4u);
    std::vector<std::string> sets = model;
    for (const char* k : {"pipeline_model_parallel_size=2", "expert_model_parallel_size=2",
                          "moe_expert_exchange=nccl", "moe_expert_rank_capacity_factor=0.5"})
        sets.push_back(k);
    const auto ranks = train_threads(4, trainer_recipe(4, sets), "pp2xep2-budget-0.5");
    expect_metrics_match("pp2xep2-budget-0.5", one, ranks, 1e-5, true);
    for (size_t r = 0; r < ranks.size(); ++r) {
        ASSERT_EQ(ranks[r].size(), one.size());
        for (size_t i = 0; i < ranks[r].size(); ++i) {
            EXPECT_TRUE(ranks[r][i].moe_budget_redo) << "rank " << r << " step " << i + 1;
            EXPECT_FALSE(ranks[r][i].skipped) << "rank " << r << ": the redo's update ran";
        }
        EXPECT_EQ(ranks[r].back().moe_budget_redos, 4) << "rank " << r;
    }
}

#endif
