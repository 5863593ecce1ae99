// Context parallelism's indexer in query blocks on CUDA, on one GPU: two CP ranks as threads
// (tests/gpu/thread_training.h), each scoring its rows against every gathered key row one block
// of query rows at a time (dsa_indexer_query_block below its rows), against one GPU running the
// micro-batches whole. The blocks' top-k, indexer loss and key gradients (every block adding
// into the gathered keys' gradient, summed over the ranks) must give the one-GPU run's losses,
// gradient norms and routing, with the sparse and the dense indexer loss.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu/harness.h"

#if SPARSETRON_WITH_CUDA
#include "gpu/thread_training.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaContextParallel, Skipped) {
    GTEST_SKIP() << "built without CUDA: GPU tests run on the GPU machine";
}
#else

TEST(CudaContextParallel, IndexerInQueryBlocksMatchesOneGpu) {
    REQUIRE_GPU();
    // 256-token micro-batches: a CP rank computes ~136 rows, 5 blocks of 32.
    for (const std::string loss : {"true", "false"}) {
        const std::vector<std::string> model = {"dsa_indexer_query_block=32",
                                                "dsa_indexer_loss_coeff=0.1",
                                                "dsa_indexer_use_sparse_loss=" + loss};
        const std::string tag = "cp2-blocks-sparse-loss-" + loss;
        const auto one = train(trainer_recipe(1, model),
                               {temp_dir(tag + "-one"), "", Device::CUDA, false, nullptr});
        ASSERT_EQ(one.size(), 4u);
        std::vector<std::string> sets = model;
        sets.push_back("context_parallel_size=2");
        // CP's GEMMs over half the rows may round a router score across a tie: step 1's loads
        // are compared as totals (test_multigpu's CP tolerances). With the sparse loss one GPU
        // runs the masked attention in its expanded form, CP in the absorbed one (CP has no
        // expanded form): step 1's gradient norms differ by the two forms' bf16 rounding (seen
        // 1.4e-4; with the dense loss, both absorbed, 5e-5).
        expect_metrics_match(tag, one, train_threads(2, trainer_recipe(2, sets), tag), 1e-5, false,
                             loss == "true" ? 3e-4 : 0);
    }
}

#endif
