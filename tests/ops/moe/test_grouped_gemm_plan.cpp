// The grouped GEMM's plan (ops/moe/grouped_gemm_plan.h), on the CPU: each form where its rule
// says, and the supported forms the GPU tests walk.
#include <gtest/gtest.h>

#include "sparsetron/ops/moe/grouped_gemm_plan.h"

using namespace sparsetron::cuda;

TEST(GroupedGemm, PlanRules) {
    GroupedGemmShape s{.n = 2048, .k = 6144, .aligned = true, .sm90a = true};
    EXPECT_EQ(plan_grouped_gemm(s), GroupedGemmForm::Wgmma);
    EXPECT_EQ(supported_grouped_gemm_forms(s),
              (std::vector<GroupedGemmForm>{GroupedGemmForm::Wgmma, GroupedGemmForm::Wmma,
                                            GroupedGemmForm::Simple}));
    s.sm90a = false;
    EXPECT_EQ(plan_grouped_gemm(s), GroupedGemmForm::Wmma);
    s.aligned = false;
    EXPECT_EQ(plan_grouped_gemm(s), GroupedGemmForm::Simple);
    s.aligned = true;
    s.n = 36;  // not a multiple of 8: no tensor-core form
    EXPECT_EQ(supported_grouped_gemm_forms(s),
              std::vector<GroupedGemmForm>{GroupedGemmForm::Simple});
    s.n = 64, s.weight_stride = 64 * 6144 + 4;  // a stride off the 16-byte grid
    EXPECT_EQ(plan_grouped_gemm(s), GroupedGemmForm::Simple);
}
