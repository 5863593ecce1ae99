// Test data for FP8 blockwise scaling (CPU reference and CUDA tests): random values whose
// magnitude changes by up to 2^12 from one 128x128 block to the next, so per-block scales matter
// (a single scale would flush the small blocks to zero).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "sparsetron/core/rng.h"

namespace sparsetron::test {

inline std::vector<float> fp8_blocky_values(int64_t rows, int64_t cols, uint64_t seed) {
    CounterRng rng(seed, 4);
    std::vector<float> x(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
            const int64_t block = (r / 128) * 7 + c / 128;
            const float mag = std::ldexp(1.f, int((block * 5) % 13) - 6);
            const uint64_t i = uint64_t(r * cols + c);
            x[size_t(i)] = mag * float(2.0 * rng.uniform(i) - 1.0);
        }
    return x;
}

}  // namespace sparsetron::test
