// The activation policy (config/activation_policy.h): the recompute and offload keys parsed into
// enums, how each saved output lives, and the recompute module an offloaded output pairs with.
#include <gtest/gtest.h>

#include "sparsetron/config/activation_policy.h"
#include "sparsetron/core/error.h"

using namespace sparsetron;

TEST(ActivationPolicy, SavesRecomputedBeforeOffloadedElseKept) {
    const ActivationPolicy a = ActivationPolicy::parse("selective", {"core_attn"}, true,
                                                       {"qkv_linear", "fused_group_mlp"});
    using Saving = ActivationPolicy::Saving;
    EXPECT_EQ(a.saves(RecomputeModule::CoreAttn, OffloadModule::AttnProj), Saving::Recomputed);
    EXPECT_EQ(a.saves(RecomputeModule::MlaUpProj, OffloadModule::QkvLinear), Saving::Offloaded);
    EXPECT_EQ(a.saves(std::nullopt, OffloadModule::ExpertOut), Saving::Offloaded)
        << "fused_group_mlp names the routed experts' output rows";
    EXPECT_EQ(a.saves(RecomputeModule::Layernorm, OffloadModule::AttnNorm), Saving::Kept);
    EXPECT_EQ(a.saves(std::nullopt, std::nullopt), Saving::Kept);
    // Without selective granularity nothing is recomputed; without the offload switch nothing is
    // offloaded, whatever the lists name.
    const ActivationPolicy none =
        ActivationPolicy::parse("", recompute_module_names(), false, {"attn_norm"});
    for (size_t m = 0; m < recompute_module_names().size(); ++m)
        EXPECT_FALSE(none.recomputes(RecomputeModule(m)));
    EXPECT_FALSE(none.offloads_any());
    EXPECT_TRUE(ActivationPolicy::parse("selective", recompute_module_names(), false, {})
                    .recomputes_everything());
    EXPECT_FALSE(a.recomputes_everything());
}

TEST(ActivationPolicy, EveryOffloadedOutputPairsWithItsRecomputeModule) {
    // Offloading what is recomputed is refused for each pair, and allowed otherwise.
    for (size_t o = 0; o + 1 < offload_module_names().size(); ++o) {
        const auto twin = recompute_twin(OffloadModule(o));
        const std::string name = offload_module_names()[o];
        if (!twin) {
            EXPECT_NO_THROW(
                ActivationPolicy::parse("selective", recompute_module_names(), true, {name}))
                << name;
            continue;
        }
        EXPECT_THROW(ActivationPolicy::parse("selective", {module_name(*twin)}, true, {name}),
                     Error)
            << name;
        EXPECT_NO_THROW(ActivationPolicy::parse("", {module_name(*twin)}, true, {name})) << name;
    }
    EXPECT_THROW(ActivationPolicy::parse("selective", {"moe_act"}, true, {"fused_group_mlp"}),
                 Error);
}
