// The rows a context-parallel rank's model is planned for (parallel/context/cp_row_plan.h), shared
// by the CPU plan and the CUDA engine: without CP the micro-batch itself, with fixed CP the rank's
// chunks of every document, with dynamic CP the largest group's micro-batch.
#include <gtest/gtest.h>

#include <string>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/error.h"
#include "sparsetron/parallel/context/cp_row_plan.h"
#include "sparsetron/parallel/context/cp_shard.h"
#include "sparsetron/runtime/trainer.h"

using namespace sparsetron;

TEST(CpRowPlan, NoneFixedAndDynamic) {
    RunConfig r;
    r.world_size = 4;
    CpRowPlan p = cp_row_plan(r, 4096, 64);
    EXPECT_EQ(p.rows, 4096);
    EXPECT_EQ(p.key_rows, 0) << "no CP: the model reads its own rows as keys";
    EXPECT_EQ(p.max_documents, 64);
    EXPECT_EQ(p.slots, 4096);
    EXPECT_EQ(p.max_group, 1);

    r.context_parallel_size = 2;
    p = cp_row_plan(r, 4096, 64);
    EXPECT_EQ(p.rows, cp_local_tokens(4096, 64, 2));
    EXPECT_EQ(p.rows, 2048 + 128);
    EXPECT_EQ(p.key_rows, 4096);
    EXPECT_EQ(p.slots, 4096);
    EXPECT_EQ(p.max_group, 2) << "the key exchange holds the CP group's rows";

    // Dynamic: groups of up to 4 ranks x 1024 tokens; a rank holds < 1024 + 2 x documents rows.
    r.context_parallel_size = 4;
    r.dynamic_context_parallel = true;
    r.max_seqlen_per_dp_cp_rank = 1024;
    p = cp_row_plan(r, 4096, 64);
    EXPECT_EQ(p.slots, 4 * 1024);
    EXPECT_EQ(p.key_rows, 4 * 1024);
    EXPECT_EQ(p.max_documents, 64) << "default_max_documents(4096)";
    EXPECT_EQ(p.rows, 1024 + 2 * 64);
    EXPECT_EQ(p.max_group, 4) << "the largest group: every DP x CP rank of the stage";
    EXPECT_GE(p.max_group * p.rows, p.key_rows) << "the exchange's blocks hold every key row";
    r.max_documents_per_microbatch = 8;
    p = cp_row_plan(r, 4096, 64);
    EXPECT_EQ(p.max_documents, 8);
    EXPECT_EQ(p.rows, 1024 + 16);
    // A rank's share never exceeds the group's micro-batch.
    r.max_seqlen_per_dp_cp_rank = 16;
    r.max_documents_per_microbatch = 64;
    p = cp_row_plan(r, 4096, 64);
    EXPECT_EQ(p.rows, p.key_rows);
    EXPECT_EQ(p.key_rows, 64);
}

// Context parallelism needs DSA (it shards attention through the one-head latent keys): a dense
// model planned for CP stops with a message naming the key.
TEST(CpRowPlan, DenseAttentionUnderCpIsAClearError) {
    Recipe r = load_recipe("", {"experimental_attention_variant=none", "dsa_indexer_loss_coeff=0",
                                "world_size=2", "context_parallel_size=2"});
    std::string msg;
    try {
        make_training_plan(r, Device::CPU);
    } catch (const Error& e) {
        msg = e.what();
    }
    EXPECT_NE(msg.find("context parallelism is implemented for DSA attention"), std::string::npos)
        << msg;
    // The same recipe without CP plans.
    r.run.context_parallel_size = 1;
    r.run.world_size = 1;
    EXPECT_NO_THROW(make_training_plan(r, Device::CPU));
}
