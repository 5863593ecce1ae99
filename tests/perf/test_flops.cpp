// Audited FLOPs (SPEC §8) against the seed's published figure.
#include <gtest/gtest.h>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/perf/flops.h"

using namespace sparsetron;

TEST(Flops, SeedSixteenGpuProxyAtThd4kMatchesThePublishedFigure) {
    // The seed's formal workload: the 16-GPU recipe at THD4K, GBS 64 x one 4096-token document.
    Recipe r = load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-16gpu.yaml", {});
    const FlopCount f = audited_flops(r.model, std::vector<int64_t>(64, 4096));
    const double seed = 36.4994e15;
    std::cout << "audited " << f.total / 1e15 << " PFLOP/step (seed 36.4994)\n";
    EXPECT_NEAR(f.total, seed, 1e-3 * seed);
    double sum = 0;
    for (auto& [name, v] : f.terms) sum += v;
    EXPECT_DOUBLE_EQ(sum, f.total);
    EXPECT_EQ(f.tokens, 64 * 4096);
}

TEST(Flops, AttentionFollowsTheTopkAndOnlyRealTokensCount) {
    Recipe r =
        load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml", {});
    const FlopCount a = audited_flops(r.model, {4096});
    r.model.dsa_indexer_topk = 1024;
    const FlopCount b = audited_flops(r.model, {4096});
    EXPECT_LT(b.total, a.total);
    // Two documents of 2048 have fewer causal pairs than one of 4096 (same tokens).
    const FlopCount c = audited_flops(r.model, {2048, 2048});
    EXPECT_LT(c.total, a.total);
    EXPECT_EQ(c.tokens, 4096);
}
