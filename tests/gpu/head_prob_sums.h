// The DSA indexer loss's teacher in fp64, the reference for the sparse MQA forwards' prob_sum:
// Σ_h exp(scale q_h · k_{idx[t, j]} - lse[h, t]) for each selected key j < len[t], 0 past it.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace sparsetron::test {

inline std::vector<float> head_prob_sums(const std::vector<float>& q, const std::vector<float>& kv,
                                         const std::vector<int32_t>& idx,
                                         const std::vector<int32_t>& len,
                                         const std::vector<float>& lse, int64_t tokens,
                                         int64_t heads, int64_t dqk, int64_t kslots, double scale) {
    std::vector<float> sums(tokens * kslots, 0.f);
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t j = 0; j < len[t]; ++j) {
            double sum = 0;
            for (int64_t h = 0; h < heads; ++h) {
                double d = 0;
                for (int64_t i = 0; i < dqk; ++i)
                    d += double(q[(t * heads + h) * dqk + i]) * kv[idx[t * kslots + j] * dqk + i];
                sum += std::exp(d * scale - lse[h * tokens + t]);
            }
            sums[t * kslots + j] = float(sum);
        }
    return sums;
}

}  // namespace sparsetron::test
