// The norm family on CUDA against the CPU reference: RMSNorm (strided rows, the vector kernels)
// and LayerNorm, forward and backward.
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
#include "sparsetron/ops/norm/norm.h"

#if SPARSETRON_WITH_CUDA
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(NormCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The norm family's CUDA tests: the shared op fixture (op_fixtures.h).
class NormCuda : public CudaOps {};

TEST_F(NormCuda, RmsNormForwardBackwardStrided) {
    const int64_t rows = 130, dim = 200, ldx = 230, ldy = 210;
    Rounded x(rows * ldx, 21), w(dim, 22), dy(rows * ldy, 23), dx0(rows * ldx, 24);
    DeviceArray<bf16> y(rows * ldy);
    DeviceArray<float> rstd(rows);
    cuda::rmsnorm_forward(ctx(), x.dev, ldx, w.dev, rows, dim, 1e-6f, y, ldy, rstd);
    // Backward accumulating into an existing dx with row stride ldx, and dw += .
    DeviceArray<bf16> dx(to_bf16_rounding(dx0.host));
    auto dw0 = random_vector<float>(dim, 25);
    DeviceArray<float> dw(dw0), ws(cuda::rmsnorm_ws_floats(rows, dim));
    cuda::rmsnorm_backward(ctx(), dy.dev, ldy, x.dev, ldx, w.dev, rstd, rows, dim, dx, ldx, true,
                           dw, ws);
    sync();
    std::vector<float> yref(rows * ldy, 0.f), rref(rows), dxref = dx0.host, dwref = dw0;
    cpu::rmsnorm_forward<float>(x.host.data(), ldx, w.host.data(), rows, dim, 1e-6, yref.data(),
                                ldy, rref.data());
    cpu::rmsnorm_backward<float>(dy.host.data(), ldy, x.host.data(), ldx, w.host.data(),
                                 rref.data(), rows, dim, dxref.data(), ldx, true, dwref.data());
    std::vector<bool> in_y(rows * ldy), in_x(rows * ldx);
    for (int64_t i = 0; i < rows * ldy; ++i) in_y[i] = i % ldy < dim;
    for (int64_t i = 0; i < rows * ldx; ++i) in_x[i] = i % ldx < dim;
    expect_close("rmsnorm y", download_f(y), yref, kBf16Tol, in_y);
    expect_close("rmsnorm rstd", rstd.download(), rref, kF32Tol);
    expect_close("rmsnorm dx (accumulate)", download_f(dx), dxref, kBf16Tol, in_x);
    expect_close("rmsnorm dw", dw.download(), dwref, 1e-4);
    // The columns past dim in dx must be untouched (the op only writes its rows' dim columns).
    auto dxg = dx.download();
    int64_t touched = 0;
    for (int64_t i = 0; i < rows * ldx; ++i)
        if (!in_x[i] && dxg[i].bits != float_to_bf16(dx0.host[i]).bits) ++touched;
    EXPECT_EQ(touched, 0);
    expect_guard(y, "rmsnorm");
    expect_guard(dw, "rmsnorm dw");
}

// Rows that take the 16-byte vector kernels (dim and strides multiples of 8; up to 4 vectors per
// thread: 6144 at the proxy's width) against the CPU, with and without accumulating into dx.
TEST_F(NormCuda, RmsNormVectorRows) {
    for (const auto [rows, dim, ld] : {std::array<int64_t, 3>{37, 6144, 6160}, {64, 512, 512}}) {
        for (bool acc : {false, true}) {
            SCOPED_TRACE(cat("dim ", dim, " accumulate ", acc));
            Rounded x(rows * ld, 26), w(dim, 27), dy(rows * ld, 28), dx0(rows * ld, 29);
            DeviceArray<bf16> y(rows * ld), dx(to_bf16_rounding(dx0.host));
            DeviceArray<float> rstd(rows), dw(dim), ws(cuda::rmsnorm_ws_floats(rows, dim));
            cuda::rmsnorm_forward(ctx(), x.dev, ld, w.dev, rows, dim, 1e-6f, y, ld, rstd);
            cuda::rmsnorm_backward(ctx(), dy.dev, ld, x.dev, ld, w.dev, rstd, rows, dim, dx, ld,
                                   acc, nullptr, ws);
            sync();
            std::vector<float> yref(rows * ld, 0.f), rref(rows), dxref = dx0.host;
            cpu::rmsnorm_forward<float>(x.host.data(), ld, w.host.data(), rows, dim, 1e-6,
                                        yref.data(), ld, rref.data());
            cpu::rmsnorm_backward<float>(dy.host.data(), ld, x.host.data(), ld, w.host.data(),
                                         rref.data(), rows, dim, dxref.data(), ld, acc, nullptr);
            std::vector<bool> in(rows * ld);
            for (int64_t i = 0; i < rows * ld; ++i) in[i] = i % ld < dim;
            expect_close("rmsnorm y (vector)", download_f(y), yref, kBf16Tol, in);
            expect_close("rmsnorm rstd (vector)", rstd.download(), rref, kF32Tol);
            expect_close("rmsnorm dx (vector)", download_f(dx), dxref, kBf16Tol, in);
            expect_guard(y, "rmsnorm (vector)");
            expect_guard(dx, "rmsnorm dx (vector)");
        }
    }
}

TEST_F(NormCuda, LayerNormForwardBackward) {
    const int64_t rows = 140, dim = 128;
    Rounded x(rows * dim, 31, 2.0), w(dim, 32), b(dim, 33), dy(rows * dim, 34);
    DeviceArray<bf16> y(rows * dim), dx(rows * dim);
    DeviceArray<float> mean(rows), rstd(rows), ws(2 * cuda::rmsnorm_ws_floats(rows, dim));
    auto dw0 = random_vector<float>(dim, 35), db0 = random_vector<float>(dim, 36);
    DeviceArray<float> dw(dw0), db(db0);
    cuda::layernorm_forward(ctx(), x.dev, w.dev, b.dev, rows, dim, 1e-6f, y, mean, rstd);
    cuda::layernorm_backward(ctx(), dy.dev, x.dev, w.dev, mean, rstd, rows, dim, dx, dw, db, ws);
    sync();
    std::vector<float> yr(rows * dim), mr(rows), rr(rows), dxr(rows * dim), dwr = dw0, dbr = db0;
    cpu::layernorm_forward<float>(x.host.data(), w.host.data(), b.host.data(), rows, dim, 1e-6,
                                  yr.data(), mr.data(), rr.data());
    cpu::layernorm_backward<float>(dy.host.data(), x.host.data(), w.host.data(), mr.data(),
                                   rr.data(), rows, dim, dxr.data(), dwr.data(), dbr.data());
    expect_close("layernorm y", download_f(y), yr, kBf16Tol);
    expect_close("layernorm mean", mean.download(), mr, kF32Tol);
    expect_close("layernorm rstd", rstd.download(), rr, kF32Tol);
    expect_close("layernorm dx", download_f(dx), dxr, kBf16Tol);
    expect_close("layernorm dw", dw.download(), dwr, 1e-4);
    expect_close("layernorm db", db.download(), dbr, 1e-4);
    expect_guard(dx, "layernorm dx");
}

#endif  // SPARSETRON_WITH_CUDA
