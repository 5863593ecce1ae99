// bf16 gradient buffers (grad_reduce_in_bf16) on CUDA: the weights only GEMMs write accumulate
// their gradients over micro-batches in bf16 and reduce them in bf16; the embedding's, the
// router's and the norms' stay fp32. On one GPU the run tracks the fp32-gradient run within bf16
// rounding (step 1's forward is the same computation); two data-parallel ranks as threads
// (bf16 all-reduces; with the distributed optimizer, AdamW and Muon reading bf16 gradients)
// track one GPU with bf16 buffers, which sums the same gradients in another order.
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
TEST(CudaBf16Gradients, Skipped) {
    GTEST_SKIP() << "built without CUDA: GPU tests run on the GPU machine";
}
#else

TEST(CudaBf16Gradients, TrackFp32GradientsOnOneGpuAndMatchItOverDataParallelThreads) {
    REQUIRE_GPU();
    for (const std::string opt : {"adamw", "muon"}) {
        const std::vector<std::string> model = {"optimizer=" + opt};
        std::vector<std::string> half = model;
        half.push_back("grad_reduce_in_bf16=true");
        const auto fp32 = train(trainer_recipe(1, model),
                                {temp_dir(opt + "-fp32-grads"), "", Device::CUDA, false, nullptr});
        const auto bf16 = train(trainer_recipe(1, half),
                                {temp_dir(opt + "-bf16-grads"), "", Device::CUDA, false, nullptr});
        ASSERT_EQ(fp32.size(), 4u);
        ASSERT_EQ(bf16.size(), 4u);
        for (size_t i = 0; i < 4; ++i) {
            const StepMetrics &b = bf16[i], &f = fp32[i];
            std::cout << "[bf16 gradients " << opt << "] step " << i + 1 << ": lm " << b.lm_loss
                      << " vs " << f.lm_loss << ", grad_norm " << b.grad_norm << " vs "
                      << f.grad_norm << "\n";
            // Step 1's losses come before any update: the same kernels on the same weights.
            const double loss_tol = i == 0 ? 1e-6 : 2e-3;
            EXPECT_NEAR(b.lm_loss, f.lm_loss, loss_tol * f.lm_loss) << opt << " step " << i + 1;
            EXPECT_NEAR(b.mtp_loss, f.mtp_loss, loss_tol * f.mtp_loss) << opt << " step " << i + 1;
            // The gradients' bf16 rounding: a relative error of about 2^-9 per element.
            EXPECT_NEAR(b.grad_norm, f.grad_norm, 1e-2 * f.grad_norm) << opt << " step " << i + 1;
            EXPECT_FALSE(b.skipped);
        }
        // The key changed the gradients (a run that ignored it would match to the last bits).
        EXPECT_NE(bf16[0].grad_norm, fp32[0].grad_norm) << opt;
        for (const bool dist : {false, true}) {
            std::vector<std::string> sets = half;
            if (dist) sets.push_back("use_distributed_optimizer=true");
            const std::string tag = opt + (dist ? "-bf16-grads-dp2-dist" : "-bf16-grads-dp2");
            // One GPU sums the batch's micro-batches into bf16 one after another, two ranks
            // sum half each and add the halves: bf16 roundings in another order.
            expect_metrics_match(tag, bf16, train_threads(2, trainer_recipe(2, sets), tag), 1e-5,
                                 false, 1e-2, 2e-3);
        }
    }
}

// With the FP8 linears (their weight-gradient GEMMs writing the bf16 gradients), the FP8 head and
// the step replayed as a full-iteration graph: the same tracking of the fp32-gradient run.
TEST(CudaBf16Gradients, TrackFp32GradientsWithFp8AndTheStepGraph) {
    REQUIRE_GPU();
    const std::vector<std::string> model = {"optimizer=muon", "fp8_recipe=blockwise",
                                            "fp8_output_proj=true"};
    std::vector<std::string> half = model;
    for (const char* s : {"grad_reduce_in_bf16=true", "cuda_graph_impl=full_iteration",
                          "cuda_graph_warmup_steps=1"})
        half.push_back(s);
    const auto fp32 = train(trainer_recipe(1, model),
                            {temp_dir("fp8-fp32-grads"), "", Device::CUDA, false, nullptr});
    const auto bf16 = train(trainer_recipe(1, half),
                            {temp_dir("fp8-bf16-grads-graph"), "", Device::CUDA, false, nullptr});
    ASSERT_EQ(fp32.size(), 4u);
    ASSERT_EQ(bf16.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
        const StepMetrics &b = bf16[i], &f = fp32[i];
        std::cout << "[bf16 gradients fp8 graph] step " << i + 1 << ": lm " << b.lm_loss << " vs "
                  << f.lm_loss << ", grad_norm " << b.grad_norm << " vs " << f.grad_norm
                  << (b.graph ? " (replay)" : "") << "\n";
        const double loss_tol = i == 0 ? 1e-6 : 2e-3;
        EXPECT_NEAR(b.lm_loss, f.lm_loss, loss_tol * f.lm_loss) << "step " << i + 1;
        EXPECT_NEAR(b.grad_norm, f.grad_norm, 1e-2 * f.grad_norm) << "step " << i + 1;
        EXPECT_EQ(b.graph, i >= 1) << "step " << i + 1;
    }
    EXPECT_NE(bf16[0].grad_norm, fp32[0].grad_norm);
}

#endif
