// The dense warm-up's check on a trainer's weights (its host plan, where a CUDA run downloads
// them for its checkpoint): every parameter's values before a run, then that only the DSA
// indexers' weights moved, and some of them did.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "sparsetron/model/param_table.h"
#include "sparsetron/runtime/trainer.h"

namespace sparsetron::test {

inline std::vector<std::vector<float>> parameter_values(const Trainer& t) {
    std::vector<std::vector<float>> out;
    for (const ParamInfo& p : t.params().params()) {
        const float* v = t.plan().view(p.param_slot).ptr<float>();
        out.emplace_back(v, v + p.numel());
    }
    return out;
}

inline void expect_only_indexers_moved(const Trainer& t,
                                       const std::vector<std::vector<float>>& before) {
    const auto& params = t.params().params();
    ASSERT_EQ(before.size(), params.size());
    int moved = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        const float* now = t.plan().view(params[i].param_slot).ptr<float>();
        const bool same = std::equal(before[i].begin(), before[i].end(), now);
        const bool indexer = is_indexer_param(params[i].name);
        if (!indexer) {
            EXPECT_TRUE(same) << params[i].name << " moved during the dense warm-up";
        }
        moved += indexer && !same;
    }
    EXPECT_GT(moved, 0) << "no indexer weight moved";
}

}  // namespace sparsetron::test
