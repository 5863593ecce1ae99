// Trainers of a parallel layout as threads of one test process on one GPU (ThreadComm: every
// collective through the host, so the runs are eager), compared with one GPU running the whole
// model: the parallel trainer paths (pipeline stages, context parallelism, their combinations)
// tested where only one GPU is available.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu/thread_comm.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

namespace sparsetron::test {

// The tiny recipe for `world` ranks, eager, with a validation split.
inline Recipe trainer_recipe(int world, std::vector<std::string> extra) {
    std::vector<std::string> sets = {"dsa_indexer_topk=128",
                                     "cuda_graph_impl=none",
                                     "train_iters=4",
                                     "split=80,20,0",
                                     "eval_interval=2",
                                     "eval_iters=1",
                                     "world_size=" + std::to_string(world)};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_recipe("", sets);
}

inline std::vector<StepMetrics> train(const Recipe& r, const TrainOptions& o) {
    Trainer t(r, o);
    std::vector<StepMetrics> out;
    t.run([&](const StepMetrics& m) { out.push_back(m); });
    return out;
}

// `world` trainers of `r` as threads of this process on one GPU (rank r writes to its own
// directory under `tag`); every rank's metrics, or the test fails naming a rank's error.
inline std::vector<std::vector<StepMetrics>> train_threads(int world, const Recipe& r,
                                                           const std::string& tag,
                                                           bool save = false) {
    auto group = std::make_shared<ThreadGroup>(world);
    std::vector<std::vector<StepMetrics>> got(static_cast<size_t>(world));
    std::vector<std::string> errors(static_cast<size_t>(world));
    std::vector<std::string> dirs;
    for (int rank = 0; rank < world; ++rank)
        dirs.push_back(temp_dir(tag + "-rank" + std::to_string(rank)));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank)
        threads.emplace_back([&, rank] {
            try {
                ThreadComm comm(group, rank);
                got[size_t(rank)] = train(r, {dirs[size_t(rank)], "", Device::CUDA, save, &comm});
            } catch (const std::exception& e) {
                errors[size_t(rank)] = e.what();
                group->fail();  // the other ranks stop waiting for this one
            }
        });
    for (auto& t : threads) t.join();
    // The failing rank's error, not the others' "another rank failed".
    for (int rank = 0; rank < world; ++rank)
        EXPECT_EQ(errors[size_t(rank)], "") << tag << " rank " << rank;
    return got;
}

// Every rank's metrics against the one-GPU run's: step 1 starts from the same weights (losses
// `step1_tol`, gradient norm 10x or `step1_grad_norm_tol` where given); later steps carry Adam's
// amplification of last-bit differences in the gradient sums. `loads_equal`: step 1's expert
// loads equal, else only their totals (CP's GEMMs over half the rows may round a router score
// across a tie).
inline void expect_metrics_match(const std::string& tag, const std::vector<StepMetrics>& one,
                                 const std::vector<std::vector<StepMetrics>>& ranks,
                                 double step1_tol, bool loads_equal, double step1_grad_norm_tol = 0,
                                 double later_tol = 2e-4) {
    for (size_t rank = 0; rank < ranks.size(); ++rank) {
        const auto& got = ranks[rank];
        ASSERT_EQ(got.size(), one.size()) << tag << " rank " << rank;
        for (size_t i = 0; i < one.size(); ++i) {
            const StepMetrics &a = got[i], &w = one[i];
            const double tol = i == 0 ? step1_tol : later_tol;
            if (rank == 0)
                std::cout << "[" << tag << "] step " << i + 1 << ": lm " << a.lm_loss << " vs "
                          << w.lm_loss << ", mtp " << a.mtp_loss << " vs " << w.mtp_loss
                          << ", indexer " << a.indexer_loss << " vs " << w.indexer_loss
                          << ", grad_norm " << a.grad_norm << " vs " << w.grad_norm << "\n";
            EXPECT_EQ(a.targets, w.targets) << tag;
            EXPECT_NEAR(a.lm_loss, w.lm_loss, tol * w.lm_loss) << tag << " step " << i + 1;
            EXPECT_NEAR(a.mtp_loss, w.mtp_loss, tol * w.mtp_loss) << tag << " step " << i + 1;
            EXPECT_GT(a.indexer_loss, 0) << tag;
            EXPECT_NEAR(a.indexer_loss, w.indexer_loss, 10 * tol * w.indexer_loss)
                << tag << " step " << i + 1;
            const double grad_tol =
                i == 0 && step1_grad_norm_tol > 0 ? step1_grad_norm_tol : 10 * tol;
            EXPECT_NEAR(a.grad_norm, w.grad_norm, grad_tol * w.grad_norm)
                << tag << " step " << i + 1;
            ASSERT_EQ(a.moe_load.size(), w.moe_load.size()) << tag << ": every stage's layers";
            if (i == 0 && loads_equal) {
                EXPECT_EQ(a.moe_load, w.moe_load) << tag;
            } else if (i == 0 && rank == 0) {
                int64_t moved = 0;  // rows routed to another expert than on one GPU
                for (size_t l = 0; l < w.moe_load.size(); ++l)
                    for (size_t e = 0; e < w.moe_load[l].size() && e < a.moe_load[l].size(); ++e)
                        moved += std::abs(a.moe_load[l][e] - w.moe_load[l][e]);
                std::cout << "[" << tag << "] step 1: " << moved / 2
                          << " routed rows on other experts than on one GPU\n";
            }
            for (size_t l = 0; l < w.moe_load.size(); ++l) {
                int64_t ta = 0, tw = 0;
                for (int64_t x : a.moe_load[l]) ta += x;
                for (int64_t x : w.moe_load[l]) tw += x;
                EXPECT_EQ(ta, tw) << tag << ": every row routed, layer " << l;
            }
            ASSERT_EQ(a.valid.has_value(), w.valid.has_value()) << tag << " step " << i + 1;
            if (w.valid) {
                EXPECT_EQ(a.valid->targets, w.valid->targets) << tag;
                EXPECT_NEAR(a.valid->lm_loss, w.valid->lm_loss, tol * w.valid->lm_loss) << tag;
                EXPECT_NEAR(a.valid->mtp_loss, w.valid->mtp_loss, tol * w.valid->mtp_loss) << tag;
            }
        }
    }
}

}  // namespace sparsetron::test
