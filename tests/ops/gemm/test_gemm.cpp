// The GEMM family's CPU reference (ops/gemm/gemm.h) against a naive fp64 product.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "sparsetron/ops/gemm/gemm.h"
#include "test_util.h"

using namespace sparsetron;
using test::max_rel_error;
using test::random_vector;

TEST(Gemm, GemmAllTransposes) {
    const int64_t m = 7, n = 5, k = 9;
    for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
            auto a = random_vector<double>(m * k + 3 * 16, 1 + ta),
                 b = random_vector<double>(k * n + 3 * 16, 3 + tb);
            auto c = random_vector<double>(m * n, 5);
            auto expect = c;
            int64_t lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 1;  // padded leading dimensions
            for (int64_t i = 0; i < m; ++i)
                for (int64_t j = 0; j < n; ++j) {
                    double s = 0;
                    for (int64_t p = 0; p < k; ++p)
                        s += (ta ? a[p * lda + i] : a[i * lda + p]) *
                             (tb ? b[j * ldb + p] : b[p * ldb + j]);
                    expect[i * n + j] = 0.5 * s + 2.0 * c[i * n + j];
                }
            cpu::gemm<double>(ta, tb, m, n, k, 0.5, a.data(), lda, b.data(), ldb, 2.0, c.data(), n);
            EXPECT_LT(max_rel_error(c, expect), 1e-14) << ta << tb;
        }
}
