#include <gtest/gtest.h>

#include <cmath>

#include "sparsetron/config/model_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/model/glm5_model.h"

using namespace sparsetron;

TEST(Philox, MatchesRandom123KnownAnswers) {
    // Known-answer vectors of Philox4x32-10 from the Random123 distribution.
    auto z = philox4x32(0, 0, 0);
    EXPECT_EQ(z[0], 0x6627e8d5u);
    EXPECT_EQ(z[1], 0xe169c58du);
    EXPECT_EQ(z[2], 0xbc57ac4cu);
    EXPECT_EQ(z[3], 0x9b00dbd8u);
    auto f = philox4x32(~0ull, ~0ull, ~0ull);
    EXPECT_EQ(f[0], 0x408f276du);
    EXPECT_EQ(f[1], 0x41c83b0eu);
    EXPECT_EQ(f[2], 0xa20bc7c6u);
    EXPECT_EQ(f[3], 0x6d5451fdu);
}

TEST(CounterRng, NormalHasUnitMoments) {
    CounterRng rng(42, 7);
    double s = 0, ss = 0;
    const int n = 200000;
    for (int i = 0; i < n; ++i) {
        double x = rng.normal(i);
        s += x, ss += x * x;
    }
    EXPECT_NEAR(s / n, 0.0, 0.01);
    EXPECT_NEAR(ss / n, 1.0, 0.01);
}

TEST(CounterRng, InitializationIndependentOfThreadCount) {
    ModelConfig m;
    m.moe_layer_pattern.assign(m.num_layers, 0);
    auto init = [&](int threads) {
        set_num_threads(threads);
        MemoryPlan plan;
        Glm5Model<float> model(m, plan, 16, 2, 16);
        plan.allocate(Device::CPU);
        model.params().initialize(plan, 99, 0.02, m.num_layers);
        const char* base = plan.class_base(MemClass::Parameters);
        return std::vector<char>(base, base + plan.class_bytes(MemClass::Parameters));
    };
    auto one = init(1), three = init(3);
    set_num_threads(2);
    EXPECT_EQ(one, three);
    // And the weights are not trivially constant.
    const float* w = reinterpret_cast<const float*>(one.data());
    EXPECT_NE(w[0], w[1]);
}
