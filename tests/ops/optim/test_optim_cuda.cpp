// The optimizer kernels on CUDA against the CPU reference: the gradient norm's partial sums,
// clipping and skip flags, AdamW.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "gpu/harness.h"
#include "sparsetron/ops/optim/optim.h"

#if SPARSETRON_WITH_CUDA
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(OptimCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The optim family's CUDA tests: the shared op fixture (op_fixtures.h).
class OptimCuda : public CudaOps {};

TEST_F(OptimCuda, GradNormClipAndAdamW) {
    const int64_t n = 100000;
    auto p0 = random_vector<float>(n, 121), g = random_vector<float>(n, 122, 3.0);
    auto m0 = random_vector<float>(n, 123, 0.1), v0 = random_vector<float>(n, 124, 0.1);
    for (auto& x : v0) x = std::fabs(x);
    DeviceArray<float> dp(p0), dg(g), dm(m0), dv(v0), parts(cuda::sum_squares_blocks(n));
    DeviceArray<float> norm(1), scale(1);
    DeviceArray<int32_t> skip(1);
    DeviceArray<bf16> pb(n);
    const float max_norm = 1.0f;
    cuda::sum_squares_partials(ctx(), dg, n, parts);
    cuda::clip_scale(ctx(), parts, cuda::sum_squares_blocks(n), max_norm, norm, scale, skip);
    cuda::adamw_update(ctx(), {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3}, dp, dg, dm, dv, n, scale, skip,
                       pb);
    sync();
    const double ref_norm = std::sqrt(cpu::sum_squares(g.data(), n));
    const double ref_scale = std::min(1.0, max_norm / (ref_norm + 1e-6));
    EXPECT_NEAR(norm.download()[0], ref_norm, 1e-5 * ref_norm);
    EXPECT_NEAR(scale.download()[0], ref_scale, 1e-5 * ref_scale);
    EXPECT_EQ(skip.download()[0], 0);
    std::vector<float> pr = p0, mr = m0, vr = v0;
    cpu::adamw_update<float>(pr.data(), g.data(), mr.data(), vr.data(), n, 1e-3, 0.9, 0.95, 1e-8,
                             0.1, 3, ref_scale);
    expect_close("adamw param", dp.download(), pr, 1e-6);
    expect_close("adamw m", dm.download(), mr, 1e-5);
    expect_close("adamw v", dv.download(), vr, 1e-5);
    expect_close("adamw bf16 copy", download_f(pb), pr, kBf16Tol);
    // A non-finite gradient: the norm is inf, the step is skipped and nothing changes.
    g[77] = INFINITY;
    dg.upload(g);
    auto before = dp.download();
    cuda::sum_squares_partials(ctx(), dg, n, parts);
    cuda::clip_scale(ctx(), parts, cuda::sum_squares_blocks(n), max_norm, norm, scale, skip);
    cuda::adamw_update(ctx(), {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 4}, dp, dg, dm, dv, n, scale, skip,
                       pb);
    sync();
    EXPECT_EQ(skip.download()[0], 1);
    EXPECT_EQ(dp.download(), before);
}

// More partial sums than the clipping kernel has threads (each thread then sums several).
TEST_F(OptimCuda, GradNormOverManyPartials) {
    const int64_t n = 12'000'000;
    ASSERT_GT(cuda::sum_squares_blocks(n), 1024);
    auto g = random_vector<float>(n, 125, 2.0);
    DeviceArray<float> dg(g), parts(cuda::sum_squares_blocks(n)), norm(1), scale(1);
    DeviceArray<int32_t> skip(1);
    cuda::sum_squares_partials(ctx(), dg, n, parts);
    cuda::clip_scale(ctx(), parts, cuda::sum_squares_blocks(n), 10.f, norm, scale, skip);
    sync();
    const double ref_norm = std::sqrt(cpu::sum_squares(g.data(), n));
    EXPECT_NEAR(norm.download()[0], ref_norm, 1e-5 * ref_norm);
    EXPECT_NEAR(scale.download()[0], std::min(1.0, 10.0 / (ref_norm + 1e-6)), 1e-5);
    EXPECT_EQ(skip.download()[0], 0);
}

#endif  // SPARSETRON_WITH_CUDA
