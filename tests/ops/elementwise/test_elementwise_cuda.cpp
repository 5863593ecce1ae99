// The element-wise family on CUDA against the CPU reference: embedding, RoPE, SwiGLU.
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
#include "sparsetron/ops/elementwise/elementwise.h"

#if SPARSETRON_WITH_CUDA
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(ElementwiseCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The elementwise family's CUDA tests: the shared op fixture (op_fixtures.h).
class ElementwiseCuda : public CudaOps {};

TEST_F(ElementwiseCuda, Embedding) {
    const int64_t rows = 150, vocab = 300, dim = 72;
    Rounded table(vocab * dim, 11), dout(rows * dim, 12);
    std::vector<int32_t> tok(rows);
    for (int64_t r = 0; r < rows; ++r) tok[r] = int32_t((r * 37 + 5) % 60);  // repeats
    DeviceArray<int32_t> dtok(tok);
    DeviceArray<bf16> out(rows * dim);
    auto dt0 = random_vector<float>(vocab * dim, 13);
    DeviceArray<float> dtable(dt0);
    cuda::embedding_forward(ctx(), dtok, rows, table.dev, dim, out);
    cuda::embedding_backward(ctx(), dtok, rows, dout.dev, dim, dtable);
    sync();
    std::vector<float> ref(rows * dim), dref = dt0;
    cpu::embedding_forward<float>(tok.data(), rows, table.host.data(), vocab, dim, ref.data());
    cpu::embedding_backward<float>(tok.data(), rows, dout.host.data(), vocab, dim, dref.data());
    expect_close("embedding forward", download_f(out), ref, 0.0 + 1e-7);
    expect_close("embedding backward", dtable.download(), dref, kF32Tol);
    expect_guard(out, "embedding");
    expect_guard(dtable, "embedding backward");
    // Negative ids (an MTP input past its document's end): zero rows forward, nothing backward.
    std::vector<int32_t> some = tok;
    for (int64_t r = 0; r < rows; r += 3) some[r] = -1;
    DeviceArray<int32_t> dsome(some);
    DeviceArray<float> dtable2(dt0);
    cuda::embedding_forward(ctx(), dsome, rows, table.dev, dim, out);
    cuda::embedding_backward(ctx(), dsome, rows, dout.dev, dim, dtable2);
    sync();
    std::vector<float> ref2(rows * dim, 0.f), dref2 = dt0;
    for (int64_t r = 0; r < rows; ++r) {
        if (some[r] < 0) continue;
        for (int64_t i = 0; i < dim; ++i) {
            ref2[r * dim + i] = table.host[some[r] * dim + i];
            dref2[some[r] * dim + i] += dout.host[r * dim + i];
        }
    }
    expect_close("embedding forward, negative ids", download_f(out), ref2, 0.0 + 1e-7);
    expect_close("embedding backward, negative ids", dtable2.download(), dref2, kF32Tol);
}

TEST_F(ElementwiseCuda, RopeBothPairingsAndInverse) {
    const int64_t tokens = 90, heads = 3, dim = 64, ld_h = 80, ld_t = heads * ld_h + 7;
    std::vector<int32_t> pos(tokens);
    for (int64_t t = 0; t < tokens; ++t) pos[t] = int32_t((t * 7919) % 131072);  // up to 128K
    DeviceArray<int32_t> dpos(pos);
    for (bool inter : {false, true})
        for (bool inv : {false, true}) {
            Rounded x(tokens * ld_t, 41 + inter + 2 * inv);
            cuda::rope(ctx(), x.dev, tokens, heads, dim, ld_t, ld_h, dpos, 1e6, inter, inv);
            sync();
            std::vector<float> ref = x.host;
            cpu::rope<float>(ref.data(), tokens, heads, dim, ld_t, ld_h, pos.data(), 1e6, inter,
                             inv);
            expect_close(cat("rope interleaved=", inter, " inverse=", inv), download_f(x.dev), ref,
                         kBf16Tol);
            expect_guard(x.dev, "rope");
        }
}

// n = 5000 takes the 8-wide vector kernels, 5003 the scalar ones.
TEST_F(ElementwiseCuda, SwiGlu) {
    for (const int64_t n : {int64_t(5000), int64_t(5003)}) {
        SCOPED_TRACE(cat("n ", n));
        Rounded g(n, 51, 4.0), u(n, 52), dout(n, 53);
        DeviceArray<bf16> out(n), dg(n), du(n);
        cuda::swiglu_forward(ctx(), g.dev, u.dev, n, out);
        cuda::swiglu_backward(ctx(), g.dev, u.dev, dout.dev, n, dg, du);
        sync();
        std::vector<float> o(n), dgr(n), dur(n);
        cpu::swiglu_forward<float>(g.host.data(), u.host.data(), n, o.data());
        cpu::swiglu_backward<float>(g.host.data(), u.host.data(), dout.host.data(), n, dgr.data(),
                                    dur.data());
        expect_close("swiglu out", download_f(out), o, kBf16Tol);
        expect_close("swiglu dg", download_f(dg), dgr, kBf16Tol);
        expect_close("swiglu du", download_f(du), dur, kBf16Tol);
        expect_guard(du, "swiglu");
        expect_guard(dg, "swiglu dg");
        expect_guard(out, "swiglu out");
    }
}

#endif  // SPARSETRON_WITH_CUDA
