// The indexer's plan (ops/indexer/indexer_plan.h), on the CPU: each form where its rule says, the
// workspace the model plans, and the supported forms the GPU tests walk.
#include <gtest/gtest.h>

#include <algorithm>

#include "sparsetron/ops/indexer/indexer_plan.h"

using namespace sparsetron::cuda;

TEST(Indexer, PlanRules) {
    // The GLM-5 indexer (32 heads x 128) at 4K on sm_90a: the fused scores, one block, the GEMM
    // backward in the whole micro-batch's workspace.
    IndexerProblem p{
        .tokens = 4096, .heads = 32, .dim = 128, .query_block = 4096, .loss = true, .sm90a = true};
    IndexerPlan plan = plan_indexer(p);
    EXPECT_EQ(plan.scores, IndexerScoresForm::Wgmma);
    EXPECT_EQ(plan.query_block_rows, 4096);
    EXPECT_EQ(plan.workspace_bytes, indexer_scores_workspace_bytes(4096, 32));
    EXPECT_EQ(plan.backward, IndexerBackwardForm::Gemm);
    // Elsewhere the GEMM scores in that workspace.
    p.sm90a = false;
    EXPECT_EQ(plan_indexer(p).scores, IndexerScoresForm::Gemm);
    // At 32K in blocks of 4096: the loss backward's chunks only, linear in the length.
    p.tokens = 32768;
    plan = plan_indexer(p);
    EXPECT_EQ(plan.query_block_rows, 4096);
    EXPECT_EQ(plan.scores, IndexerScoresForm::Rows);
    EXPECT_EQ(plan.workspace_bytes,
              kIndexerLossChunkRows * indexer_scores_backward_bytes_per_token(32768, 32));
    EXPECT_EQ(plan.backward, IndexerBackwardForm::Gemm);
    p.loss = false;
    EXPECT_EQ(plan_indexer(p).workspace_bytes, 0);
    // Context parallelism: no GEMM form (query row t is not key row t), no workspace.
    IndexerProblem cp{.tokens = 2048,
                      .key_rows = 8192,
                      .heads = 32,
                      .dim = 128,
                      .query_block = 4096,
                      .loss = true,
                      .sm90a = true};
    plan = plan_indexer(cp);
    EXPECT_EQ(plan.workspace_bytes, 0);
    EXPECT_EQ(plan.backward, IndexerBackwardForm::Rows);
    EXPECT_EQ(plan.scores, IndexerScoresForm::Wgmma);
    const auto forms = supported_score_forms(cp);
    EXPECT_EQ(std::count(forms.begin(), forms.end(), IndexerScoresForm::Gemm), 0);
    // An odd shape: only the simple kernel's scores, on any device.
    const auto odd = supported_score_forms({.tokens = 8, .key_rows = 16, .heads = 3, .dim = 20});
    EXPECT_EQ(odd, std::vector<IndexerScoresForm>{IndexerScoresForm::Rows});
}
