// Shared pieces of the op-level GPU tests: the tolerances, bf16-rounded random inputs with their
// host copies, a fixed document layout, and the fixture (a CUDA session per test). Tolerances:
// outputs stored in bf16 are compared at 1e-2 normalized error (bf16 keeps 8 bits: one rounding
// of a value is up to 2^-9 relative); fp32 outputs computed from the same bf16 inputs at
// 1e-5..1e-4 (only the order of fp32 additions differs); integer outputs (top-k, routing)
// exactly. Include only where SPARSETRON_WITH_CUDA is set.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "gpu/cuda_session_test.h"
#include "gpu/harness.h"

namespace sparsetron::test {

constexpr double kBf16Tol = 1e-2;
constexpr double kF32Tol = 1e-5;

struct Rounded {
    std::vector<float> host;  // bf16-exact values for the CPU reference
    DeviceArray<bf16> dev;
    Rounded(int64_t n, uint64_t seed, double scale = 1.0)
        : host(random_vector<float>(n, seed, scale)), dev(to_bf16_rounding(host)) {}
    explicit Rounded(std::vector<float> values)
        : host(std::move(values)), dev(to_bf16_rounding(host)) {}
};

// Documents [0, 70), [70, 71), [71, 180), then padding rows up to `tokens`.
struct Docs {
    std::vector<int32_t> cu{0, 70, 71, 180};
    int32_t num_docs = 3;
    // Each of the first `tokens` rows' document start (-1 past the documents); a shorter
    // micro-batch (the CP case's 100 query rows) ends inside them.
    std::vector<int32_t> row_begin(int64_t tokens) const {
        std::vector<int32_t> rb(tokens, -1);
        for (int d = 0; d < num_docs; ++d)
            for (int32_t t = cu[d]; t < cu[d + 1] && t < tokens; ++t) rb[t] = cu[d];
        return rb;
    }
};

inline std::vector<float> download_f(const DeviceArray<bf16>& a) {
    return to_float(a.download());
}

class CudaOps : public CudaSessionTest {};

}  // namespace sparsetron::test
