// Data parallelism over MPI ranks on CPU (label mpi; ctest runs it under mpirun -np 2 and 4):
// the same tiny recipe on W ranks gives the one-process run's losses and gradient norms, every
// rank ends with identical weights, and ranks with different recipes all stop with a message.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "../test_util.h"
#include "ep_exchange_check.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/error.h"
#include "sparsetron/parallel/layout.h"
#include "sparsetron/parallel/mpi/mpi_comm.h"
#include "sparsetron/parallel/process_groups.h"
#include "sparsetron/runtime/trainer.h"

using namespace sparsetron;

namespace {

Comm* g_comm = nullptr;

Recipe small_recipe(int world, std::vector<std::string> extra = {}) {
    std::vector<std::string> sets = {
        "hidden_size=48",         "num_attention_heads=2", "q_lora_rank=32", "kv_lora_rank=24",
        "qk_head_dim=16",         "qk_pos_emb_head_dim=8", "v_head_dim=16",  "ffn_hidden_size=96",
        "seq_length=64",          "global_batch_size=4",   "train_iters=3",  "lr_warmup_iters=2",
        cat("world_size=", world)};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_recipe("", sets);
}

std::vector<StepMetrics> run(const Recipe& r, Comm* comm, const std::string& tag,
                             double* weight_sum = nullptr) {
    // Every process needs its own directory, also for the one-process reference run.
    const int rank = g_comm->rank();
    Trainer t(r, {test::temp_dir(cat(tag, ".rank", rank)), "", Device::CPU, false, comm});
    std::vector<StepMetrics> out;
    t.run([&](const StepMetrics& m) { out.push_back(m); });
    if (weight_sum) {
        const auto& plan = t.plan();
        const float* w = reinterpret_cast<const float*>(plan.class_base(MemClass::Parameters));
        double s = 0;
        for (size_t i = 0; i < plan.class_bytes(MemClass::Parameters) / 4; ++i)
            s += double(w[i]) * w[i];
        *weight_sum = s;
    }
    return out;
}

}  // namespace

TEST(Mpi, DataParallelMatchesOneProcess) {
    const int W = g_comm->size();
    double w_dp = 0;
    auto dp = run(small_recipe(W), g_comm, "dp", &w_dp);
    auto one = run(small_recipe(1), nullptr, "one");
    ASSERT_EQ(dp.size(), one.size());
    for (size_t i = 0; i < dp.size(); ++i) {
        // Same micro-batches, gradients summed in another order: fp32 rounding only.
        EXPECT_NEAR(dp[i].lm_loss, one[i].lm_loss, 1e-5 * one[i].lm_loss) << "step " << i + 1;
        EXPECT_NEAR(dp[i].mtp_loss, one[i].mtp_loss, 1e-5 * one[i].mtp_loss + 1e-9);
        EXPECT_NEAR(dp[i].indexer_loss, one[i].indexer_loss, 1e-4 * one[i].indexer_loss + 1e-12);
        EXPECT_NEAR(dp[i].grad_norm, one[i].grad_norm, 1e-4 * one[i].grad_norm);
        EXPECT_EQ(dp[i].targets, one[i].targets);
        EXPECT_EQ(dp[i].moe_load, one[i].moe_load) << "routing statistics summed over ranks";
    }
    // Every rank holds bit-identical weights after the steps.
    uint64_t bits = 0;
    std::memcpy(&bits, &w_dp, sizeof bits);
    for (uint64_t b : g_comm->allgather(bits)) EXPECT_EQ(b, bits);
}

// The distributed optimizer (each rank updates the parameters it owns, then broadcasts them) gives
// the one-process run's losses and final state, with AdamW and with Muon (whole matrices per rank);
// every trainable parameter has exactly one owner and the ranks share the work.
TEST(Mpi, DistributedOptimizerMatchesOneProcess) {
    const int W = g_comm->size();
    for (const std::string opt : {"adam", "muon"}) {
        const std::vector<std::string> extra = {"use_distributed_optimizer=true",
                                                "optimizer=" + opt};
        const Recipe rd = small_recipe(W, extra), r1 = small_recipe(1, {"optimizer=" + opt});
        const int rank = g_comm->rank();
        Trainer dist(
            rd, {test::temp_dir(cat("dist.", opt, ".rank", rank)), "", Device::CPU, false, g_comm});
        Trainer one(
            r1, {test::temp_dir(cat("one.", opt, ".rank", rank)), "", Device::CPU, false, nullptr});
        std::vector<StepMetrics> md, m1;
        dist.run([&](const StepMetrics& m) { md.push_back(m); });
        one.run([&](const StepMetrics& m) { m1.push_back(m); });
        ASSERT_EQ(md.size(), m1.size());
        for (size_t i = 0; i < md.size(); ++i) {
            EXPECT_NEAR(md[i].lm_loss, m1[i].lm_loss, 1e-5 * m1[i].lm_loss) << opt << " step " << i;
            EXPECT_NEAR(md[i].grad_norm, m1[i].grad_norm, 1e-4 * m1[i].grad_norm);
        }
        // Ownership: one owner per trainable parameter, every rank owns some.
        const auto& owners = dist.parameter_owners();
        const auto& params = dist.params().params();
        ASSERT_EQ(owners.size(), params.size());
        std::vector<int> per_rank(size_t(W), 0);
        for (size_t i = 0; i < params.size(); ++i) {
            EXPECT_EQ(owners[i] >= 0, params[i].trainable) << params[i].name;
            if (owners[i] >= 0) ++per_rank[size_t(owners[i])];
        }
        for (int c : per_rank) EXPECT_GT(c, 0);
        // The state gathered for a checkpoint equals the one-process run's.
        dist.save();
        const MemoryPlan& pd = dist.plan();
        const MemoryPlan& p1 = one.plan();
        ASSERT_EQ(pd.class_bytes(MemClass::OptimizerState),
                  p1.class_bytes(MemClass::OptimizerState));
        const size_t n = pd.class_bytes(MemClass::OptimizerState) / 4;
        const float* sd = reinterpret_cast<const float*>(pd.class_base(MemClass::OptimizerState));
        const float* s1 = reinterpret_cast<const float*>(p1.class_base(MemClass::OptimizerState));
        double num = 0, den = 0;
        for (size_t i = 0; i < n; ++i) {
            num += double(sd[i] - s1[i]) * double(sd[i] - s1[i]);
            den += double(s1[i]) * double(s1[i]);
        }
        EXPECT_LT(std::sqrt(num / den), 1e-4) << opt << ": gathered optimizer state";
        const float* wd = reinterpret_cast<const float*>(pd.class_base(MemClass::Parameters));
        double w = 0;
        for (size_t i = 0; i < pd.class_bytes(MemClass::Parameters) / 4; ++i)
            w += double(wd[i]) * wd[i];
        uint64_t bits = 0;
        std::memcpy(&bits, &w, sizeof bits);
        for (uint64_t b : g_comm->allgather(bits))
            EXPECT_EQ(b, bits) << "weights differ across ranks";
    }
}

TEST(Mpi, DifferentRecipesStopEveryRank) {
    Recipe r = small_recipe(g_comm->size());
    if (g_comm->rank() == 1) r.run.lr = 5e-3;
    std::string msg;
    try {
        Trainer t(r, {test::temp_dir(cat("mismatch.rank", g_comm->rank())), "", Device::CPU, false,
                      g_comm});
    } catch (const Error& e) {
        msg = e.what();
    }
    EXPECT_NE(msg.find("rank 1 loaded a different recipe than rank 0"), std::string::npos) << msg;
}

TEST(Mpi, WorldSizeMustMatchTheRanks) {
    std::string msg;
    try {
        const int w = 2 * g_comm->size();
        Trainer t(small_recipe(w, {cat("global_batch_size=", w)}),
                  {test::temp_dir(cat("ws.rank", g_comm->rank())), "", Device::CPU, false, g_comm});
    } catch (const Error& e) {
        msg = e.what();
    }
    EXPECT_NE(msg.find(cat("but ", g_comm->size(), " processes were started")), std::string::npos)
        << msg;
}

// Process groups made once by Comm::split from the layout's colors (ProcessGroups): each
// communicator has the layout's members (size, rank order) and a sum over it adds exactly those
// ranks; every dynamic-CP size is there.
TEST(Mpi, ProcessGroupsFromTheLayout) {
    const int W = g_comm->size(), me = g_comm->rank();
    RunConfig r;
    r.context_parallel_size = 2;
    r.expert_model_parallel_size = W;
    const ParallelLayout l = make_layout(r, W);
    const ProcessGroups g = ProcessGroups::create(*g_comm, l);
    struct Kind {
        const char* name;
        Comm* comm;
        std::vector<int> members;
    };
    std::vector<Kind> kinds = {{"cp", g.cp.get(), l.cp_group(me)},
                               {"dp", g.dp.get(), l.dp_group(me)},
                               {"ep", g.ep.get(), l.ep_group(me)},
                               {"edp", g.edp.get(), l.edp_group(me)}};
    ASSERT_EQ(g.dynamic_cp.size(), l.dynamic_cp_sizes(1).size());
    for (int size : l.dynamic_cp_sizes(1))
        kinds.push_back({"dynamic cp", &g.dynamic(size), l.dynamic_cp_group(me, size)});
    for (const Kind& k : kinds) {
        ASSERT_EQ(k.comm->size(), int(k.members.size())) << k.name;
        EXPECT_EQ(k.members[size_t(k.comm->rank())], me) << k.name << ": rank order";
        double x = double(1 << me), want = 0;
        for (int m : k.members) want += double(1 << m);
        k.comm->allreduce_sum(&x, 1);
        EXPECT_EQ(x, want) << k.name << " group of rank " << me;
    }
    EXPECT_THROW(g.dynamic(3), Error);
}

// Expert parallelism over all ranks: each routed row reaches its expert's rank and the combined
// result equals the local computation exactly (same products, same order of the gate sums).
TEST(Mpi, ExpertParallelDispatchAndCombine) {
    test::check_ep_exchange(*g_comm);
    // And within the EP groups of a layout (EP 2 when there are 4 ranks).
    RunConfig r;
    r.expert_model_parallel_size = g_comm->size() >= 4 ? 2 : g_comm->size();
    const ParallelLayout l = make_layout(r, g_comm->size());
    std::unique_ptr<Comm> ep = g_comm->split(l.ep_color(g_comm->rank()), g_comm->rank());
    test::check_ep_exchange(*ep);
}

int main(int argc, char** argv) {
    MpiComm comm(&argc, &argv);
    g_comm = &comm;
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
