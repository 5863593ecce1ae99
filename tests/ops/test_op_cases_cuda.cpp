// The op case table (ggml test-backend-ops style): every row is one op at one shape and element
// type; the harness runs it on CUDA and with the CPU reference on the same bf16-exact random
// inputs, and checks the normalized error against the row's tolerance, that no output is
// non-finite (outputs start poisoned with NaN bytes, so an unwritten element fails) and that no
// byte past an output was written (sentinel guards). A new op or shape is one row here; the
// family files (test_<family>_cuda.cpp) keep the checks that need more than that (gradients
// through several ops, routing, forms).
#include <gtest/gtest.h>

#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpu/harness.h"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/loss/loss.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/ops/norm/norm.h"

#if SPARSETRON_WITH_CUDA
#include "ops/fp8/fp8_test_data.h"
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(OpCases, Skipped) {
    GTEST_SKIP() << "built without CUDA: the op case table runs on the GPU machine";
}
#else

namespace {

// One op at one shape: `run` computes it on the device and on the CPU and checks the outputs
// (expect_close and expect_guard) at `tol`.
struct OpCase {
    std::string name;
    double tol;
    std::function<void(const cuda::CudaSession&, const std::string& name, double tol)> run;
};

// C = op(A) op(B) in bf16 (fp32 accumulation) or fp32, C [m, n].
OpCase gemm_case(bool ta, bool tb, int64_t m, int64_t n, int64_t k, DType type) {
    const bool f32 = type == DType::F32;
    const std::string name = cat("gemm ", ta ? "T" : "N", tb ? "T" : "N", " ", m, "x", n, "x", k,
                                 f32 ? " f32" : " bf16");
    return {name, f32 ? 1e-5 : 1e-2,
            [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto a = random_vector<float>(m * k, 11), b = random_vector<float>(k * n, 12);
                std::vector<float> c(m * n, 0.f), got;
                if (f32) {
                    cpu::gemm<float>(ta, tb, m, n, k, 1.f, a.data(), ta ? m : k, b.data(),
                                     tb ? k : n, 0.f, c.data(), n);
                    DeviceArray<float> da(a), db(b), dc(m * n);
                    cuda::gemm(s.ctx(), ta, tb, m, n, k, 1.f, da, ta ? m : k, db, tb ? k : n, 0.f,
                               dc, n, DType::F32, DType::F32);
                    s.synchronize();
                    expect_guard(dc, what);
                    got = dc.download();
                } else {
                    std::vector<float> ar = a, br = b;
                    DeviceArray<bf16> da(to_bf16_rounding(ar)), db(to_bf16_rounding(br)), dc(m * n);
                    cpu::gemm<float>(ta, tb, m, n, k, 1.f, ar.data(), ta ? m : k, br.data(),
                                     tb ? k : n, 0.f, c.data(), n);
                    cuda::gemm(s.ctx(), ta, tb, m, n, k, 1.f, da, ta ? m : k, db, tb ? k : n, 0.f,
                               dc, n);
                    s.synchronize();
                    expect_guard(dc, what);
                    got = to_float(dc.download());
                }
                expect_close(what, got, c, tol);
            }};
}

// The FP8 blockwise linear (SPEC §6): x [m, k] bf16 quantized 1x128, w [n, k] quantized 128x128
// from fp32 (the forward and input-gradient form) or 1x128 from bf16 (the weight-gradient form,
// fp32 output), then the block-scaled GEMM; the CPU reference quantizes alike (bit for bit) and
// sums each 128-deep block's e4m3 products in double. Values whose magnitude changes by up to
// 2^12 from block to block, so every block's own scale matters.
OpCase fp8_gemm_case(int64_t m, int64_t n, int64_t k, bool weight_grad_form) {
    return {
        cat("fp8 gemm ", weight_grad_form ? "x1x128.w1x128 f32 " : "x1x128.w128x128 bf16 ", m, "x",
            n, "x", k),
        // The weight-gradient form's fp32 output: Hopper's FP8 MMAs accumulate each 128-deep
        // block in less than fp32's precision before it is scaled and added.
        weight_grad_form ? 3e-4 : kBf16Tol,
        [=](const cuda::CudaSession& s, const std::string& what, double tol) {
            std::vector<float> x = fp8_blocky_values(m, k, 51), w = fp8_blocky_values(n, k, 52);
            DeviceArray<bf16> dx(to_bf16_rounding(x));
            std::vector<uint8_t> qx(size_t(m * k)), qw(size_t(n * k));
            std::vector<float> sx(size_t(m * fp8::blocks(k))), y(size_t(m * n));
            cpu::quantize_1x128(x.data(), m, k, k, cpu::kFp8Pow2Scales, qx.data(), sx.data());
            DeviceArray<uint8_t> dqx(m * k), dqw(n * k);
            DeviceArray<float> dsx(fp8::scales_1x128(m, k));
            const ExecContext& ctx = s.ctx();
            cuda::quantize_fp8_1x128(ctx, dx, m, k, k, cpu::kFp8Pow2Scales, dqx, dsx);
            if (weight_grad_form) {
                DeviceArray<bf16> dw(to_bf16_rounding(w));
                std::vector<float> sw(size_t(n * fp8::blocks(k)));
                cpu::quantize_1x128(w.data(), n, k, k, cpu::kFp8Pow2Scales, qw.data(), sw.data());
                cpu::gemm_fp8_blockwise(qx.data(), sx.data(), qw.data(), sw.data(), m, n, k,
                                        y.data(), /*w_1x128=*/true);
                DeviceArray<float> dsw(fp8::scales_1x128(n, k)), dy(m * n);
                cuda::quantize_fp8_1x128(ctx, dw, n, k, k, cpu::kFp8Pow2Scales, dqw, dsw);
                cuda::gemm_fp8_blockwise(ctx, m, n, k, {dqx, dsx, false}, {dqw, dsw, false},
                                         static_cast<float*>(dy), n);
                s.synchronize();
                expect_close(what, dy.download(), y, tol);
                expect_guard(dy, what);
                return;
            }
            std::vector<float> sw(size_t(fp8::blocks(n) * fp8::blocks(k)));
            cpu::quantize_128x128(w.data(), n, k, cpu::kFp8Pow2Scales, qw.data(), sw.data());
            cpu::gemm_fp8_blockwise(qx.data(), sx.data(), qw.data(), sw.data(), m, n, k, y.data());
            DeviceArray<float> dw(w), dsw(fp8::scales_128x128(n, k));
            DeviceArray<bf16> dy(m * n);
            cuda::quantize_fp8_128x128(ctx, dw, n, k, cpu::kFp8Pow2Scales, dqw, dsw);
            cuda::gemm_fp8_blockwise(ctx, m, n, k, {dqx, dsx, false}, {dqw, dsw, true}, dy, n);
            s.synchronize();
            expect_close(what, download_f(dy), y, tol);
            expect_guard(dy, what);
        }};
}

// The routed experts' FP8 grouped GEMM (grouped_gemm_fp8, sm_90a): expert e's rows
// [offsets[e], offsets[e + 1]) of x (quantized 1x128 over the whole buffer) times its W_e^T
// (128x128 from fp32); the CPU reference expert by expert. Rows past the last expert are not
// compared (the GEMM leaves them).
OpCase fp8_grouped_case(std::vector<int32_t> offsets, int64_t capacity, int64_t n, int64_t k) {
    const int64_t E = int64_t(offsets.size()) - 1;
    return {
        cat("fp8 grouped gemm ", E, " experts ", offsets.back(), "x", n, "x", k), kBf16Tol,
        [=](const cuda::CudaSession& s, const std::string& what, double tol) {
            if (!cuda::grouped_gemm_fp8_available()) GTEST_SKIP() << "needs sm_90a";
            std::vector<float> x = fp8_blocky_values(capacity, k, 61);
            DeviceArray<bf16> dx(to_bf16_rounding(x));
            std::vector<uint8_t> qx(size_t(capacity * k)), qw(size_t(n * k));
            std::vector<float> sx(size_t(capacity * fp8::blocks(k)));
            cpu::quantize_1x128(x.data(), capacity, k, k, cpu::kFp8Pow2Scales, qx.data(),
                                sx.data());
            const ExecContext& ctx = s.ctx();
            DeviceArray<uint8_t> dqx(capacity * k), dqw(E * n * k);
            DeviceArray<float> dsx(fp8::scales_1x128(capacity, k)),
                dsw(E * fp8::scales_128x128(n, k));
            cuda::quantize_fp8_1x128(ctx, dx, capacity, k, k, cpu::kFp8Pow2Scales, dqx, dsx);
            std::vector<float> ref(size_t(capacity * n), 0.f);
            std::vector<bool> mask(ref.size(), false);
            for (int64_t e = 0; e < E; ++e) {
                std::vector<float> w = fp8_blocky_values(n, k, 70 + uint64_t(e));
                DeviceArray<float> dw(w);
                cuda::quantize_fp8_128x128(ctx, dw, n, k, cpu::kFp8Pow2Scales,
                                           dqw.get() + e * n * k,
                                           dsw.get() + e * fp8::scales_128x128(n, k));
                s.synchronize();  // the stream is non-blocking: done before dw goes
                const int64_t r0 = offsets[size_t(e)], rows = offsets[size_t(e) + 1] - r0;
                if (rows == 0) continue;
                std::vector<float> sw(size_t(fp8::blocks(n) * fp8::blocks(k)));
                cpu::quantize_128x128(w.data(), n, k, cpu::kFp8Pow2Scales, qw.data(), sw.data());
                cpu::gemm_fp8_blockwise(qx.data() + r0 * k, sx.data() + r0 * fp8::blocks(k),
                                        qw.data(), sw.data(), rows, n, k, ref.data() + r0 * n);
                std::fill(mask.begin() + r0 * n, mask.begin() + (r0 + rows) * n, true);
            }
            int32_t most = 0;
            for (int64_t e = 0; e < E; ++e)
                most = std::max(most, offsets[size_t(e) + 1] - offsets[size_t(e)]);
            DeviceArray<int32_t> doff(offsets);
            DeviceArray<bf16> dy(capacity * n);
            cuda::grouped_gemm_fp8(
                ctx,
                cuda::Fp8GroupedGemm{
                    doff, E, most, capacity, n, k, {dqx, dsx, false}, {dqw, dsw, true}, dy, false});
            s.synchronize();
            expect_close(what, download_f(dy), ref, tol, mask);
            expect_guard(dy, what);
        }};
}

// y = RMSNorm(x) w, rows x dim.
OpCase rmsnorm_case(int64_t rows, int64_t dim) {
    return {cat("rmsnorm ", rows, "x", dim), 1e-2,
            [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto x = random_vector<float>(rows * dim, 21), w = random_vector<float>(dim, 22);
                DeviceArray<bf16> dx(to_bf16_rounding(x)), dw(to_bf16_rounding(w)), dy(rows * dim);
                DeviceArray<float> rstd(rows);
                cuda::rmsnorm_forward(s.ctx(), dx, dim, dw, rows, dim, 1e-6f, dy, dim, rstd);
                s.synchronize();
                std::vector<float> y(rows * dim), r(rows);
                cpu::rmsnorm_forward<float>(x.data(), dim, w.data(), rows, dim, 1e-6, y.data(), dim,
                                            r.data());
                expect_close(what, to_float(dy.download()), y, tol);
                expect_close(what + " rstd", rstd.download(), r, 1e-5);
                expect_guard(dy, what);
            }};
}

// y = LayerNorm(x) w + b, rows x dim.
OpCase layernorm_case(int64_t rows, int64_t dim) {
    return {cat("layernorm ", rows, "x", dim), 1e-2,
            [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto x = random_vector<float>(rows * dim, 31), w = random_vector<float>(dim, 32),
                     b = random_vector<float>(dim, 33);
                DeviceArray<bf16> dx(to_bf16_rounding(x)), dw(to_bf16_rounding(w)),
                    db(to_bf16_rounding(b)), dy(rows * dim);
                DeviceArray<float> mean(rows), rstd(rows);
                cuda::layernorm_forward(s.ctx(), dx, dw, db, rows, dim, 1e-6f, dy, mean, rstd);
                s.synchronize();
                std::vector<float> y(rows * dim), m(rows), r(rows);
                cpu::layernorm_forward<float>(x.data(), w.data(), b.data(), rows, dim, 1e-6,
                                              y.data(), m.data(), r.data());
                expect_close(what, to_float(dy.download()), y, tol);
                expect_close(what + " mean", mean.download(), m, 1e-5);
                expect_guard(dy, what);
            }};
}

// RoPE in place over [tokens, heads, dim] at positions 3 t + 1.
OpCase rope_case(int64_t tokens, int64_t heads, int64_t dim, bool interleaved) {
    return {cat("rope ", tokens, "x", heads, "x", dim, interleaved ? " interleaved" : " halves"),
            1e-2, [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto x = random_vector<float>(tokens * heads * dim, 41);
                std::vector<int32_t> pos(tokens);
                for (int64_t t = 0; t < tokens; ++t) pos[t] = int32_t(3 * t + 1);
                DeviceArray<bf16> dx(to_bf16_rounding(x));
                DeviceArray<int32_t> dpos(pos);
                cuda::rope(s.ctx(), dx, tokens, heads, dim, heads * dim, dim, dpos, 10000.0,
                           interleaved, false);
                s.synchronize();
                cpu::rope<float>(x.data(), tokens, heads, dim, heads * dim, dim, pos.data(),
                                 10000.0, interleaved, false);
                expect_close(what, to_float(dx.download()), x, tol);
                expect_guard(dx, what);
            }};
}

// out = silu(g) u over n elements.
OpCase swiglu_case(int64_t n) {
    return {cat("swiglu ", n), 1e-2,
            [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto g = random_vector<float>(n, 51, 3.0), u = random_vector<float>(n, 52);
                DeviceArray<bf16> dg(to_bf16_rounding(g)), du(to_bf16_rounding(u)), dout(n);
                cuda::swiglu_forward(s.ctx(), dg, du, n, dout);
                s.synchronize();
                std::vector<float> out(n);
                cpu::swiglu_forward<float>(g.data(), u.data(), n, out.data());
                expect_close(what, to_float(dout.download()), out, tol);
                expect_guard(dout, what);
            }};
}

// Rows of z [rows, vocab] (fp32) become softmax(z).
OpCase softmax_case(int64_t rows, int64_t vocab) {
    return {cat("softmax rows ", rows, "x", vocab), 1e-5,
            [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto z = random_vector<float>(rows * vocab, 61, 4.0);
                DeviceArray<float> dz(z);
                cuda::softmax_rows(s.ctx(), dz, rows, vocab);
                s.synchronize();
                cpu::softmax_rows(z.data(), rows, vocab);
                expect_close(what, dz.download(), z, tol);
                expect_guard(dz, what);
            }};
}

// The output head fused with cross-entropy over row chunks: the loss sum and target count, the
// input gradient dh (bf16) and the weight gradient dw (fp32, overwritten), every fifth row
// without a target. The dlogits are rounded to bf16 before both gradient GEMMs on CUDA: the
// bf16 tolerance for the gradients, the loss in fp32 against fp64.
OpCase head_cross_entropy_case(int64_t rows, int64_t dim, int64_t vocab, int64_t chunk) {
    return {cat("head cross-entropy ", rows, "x", dim, " vocab ", vocab, " chunk ", chunk),
            kBf16Tol, [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto h = random_vector<float>(rows * dim, 81),
                     w = random_vector<float>(vocab * dim, 82);
                std::vector<int32_t> targets(static_cast<size_t>(rows));
                for (int64_t r = 0; r < rows; ++r)
                    targets[size_t(r)] = r % 5 == 4 ? -1 : int32_t((r * 7919) % vocab);
                DeviceArray<bf16> dh_in(to_bf16_rounding(h)), dwb(to_bf16_rounding(w)),
                    ddh(rows * dim);
                DeviceArray<int32_t> dtargets(targets);
                const int64_t dl_rows = cuda::head_dlogits_rows(rows, chunk, dim);
                DeviceArray<float> logits(chunk * vocab), row_loss(rows), ddw(vocab * dim);
                DeviceArray<bf16> dlogits(dl_rows * vocab);
                DeviceArray<double> sums(2);
                cuda::HeadLoss p;
                p.h = dh_in, p.rows = rows, p.dim = dim, p.w = dwb, p.vocab = vocab;
                p.targets = dtargets, p.chunk_rows = chunk, p.logits_ws = logits;
                p.dlogits_ws = dlogits, p.dlogits_rows = dl_rows, p.grad_scale = 0.5f;
                p.dw_beta = 0.f;
                cuda::head_cross_entropy(s.ctx(), p, row_loss, ddh, static_cast<float*>(ddw));
                cuda::loss_sum(s.ctx(), row_loss, dtargets, rows, sums);
                s.synchronize();
                std::vector<float> ws(static_cast<size_t>(chunk * vocab)),
                    dh(static_cast<size_t>(rows * dim)), dw(size_t(vocab * dim), 0.f);
                double loss = 0;
                int64_t count = 0;
                cpu::head_cross_entropy<float>(h.data(), rows, dim, w.data(), vocab, targets.data(),
                                               chunk, ws.data(), 0.5, dh.data(), dw.data(), &loss,
                                               &count);
                const std::vector<double> got = sums.download();
                EXPECT_NEAR(got[0], loss, 1e-5 * std::fabs(loss)) << what;
                EXPECT_EQ(int64_t(got[1]), count) << what;
                expect_close(what + " dh", download_f(ddh), dh, tol);
                expect_close(what + " dw", ddw.download(), dw, tol);
                expect_guard(ddh, what), expect_guard(ddw, what);
            }};
}

// out[r] = table[tokens[r]] (ids in the vocabulary: the CPU reference refuses others; the CUDA
// op's zero rows for negative ids are checked in test_elementwise_cuda.cpp).
OpCase embedding_case(int64_t rows, int64_t vocab, int64_t dim) {
    return {cat("embedding ", rows, " of ", vocab, "x", dim), 0.0,
            [=](const cuda::CudaSession& s, const std::string& what, double tol) {
                auto table = random_vector<float>(vocab * dim, 71);
                std::vector<int32_t> ids(rows);
                for (int64_t r = 0; r < rows; ++r) ids[r] = int32_t(r * 5 % vocab);
                DeviceArray<bf16> dt(to_bf16_rounding(table)), dout(rows * dim);
                DeviceArray<int32_t> did(ids);
                cuda::embedding_forward(s.ctx(), did, rows, dt, dim, dout);
                s.synchronize();
                std::vector<float> out(rows * dim);
                cpu::embedding_forward<float>(ids.data(), rows, table.data(), vocab, dim,
                                              out.data());
                expect_close(what, to_float(dout.download()), out, tol);
                expect_guard(dout, what);
            }};
}

std::vector<OpCase> op_cases() {
    std::vector<OpCase> c;
    for (DType t : {DType::BF16, DType::F32})
        for (auto [m, n, k] : {std::array<int64_t, 3>{64, 48, 32}, {129, 77, 200}, {1, 256, 512}})
            for (bool ta : {false, true})
                for (bool tb : {false, true}) c.push_back(gemm_case(ta, tb, m, n, k, t));
    for (auto [rows, dim] : {std::pair<int64_t, int64_t>{7, 64}, {130, 6144}, {33, 100}})
        c.push_back(rmsnorm_case(rows, dim)), c.push_back(layernorm_case(rows, dim));
    for (bool il : {false, true})
        c.push_back(rope_case(9, 4, 64, il)), c.push_back(rope_case(130, 16, 128, il));
    for (int64_t n : {int64_t(8), int64_t(1001), int64_t(65536)}) c.push_back(swiglu_case(n));
    for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{3, 1000}, {5, 154880}, {17, 998}})
        c.push_back(softmax_case(rows, vocab));
    for (auto [rows, vocab, dim] :
         {std::array<int64_t, 3>{10, 13, 64}, {300, 1000, 6144}, {21, 50, 100}})
        c.push_back(embedding_case(rows, vocab, dim));
    for (auto [rows, dim, vocab, chunk] :
         {std::array<int64_t, 4>{37, 64, 1000, 16}, {256, 256, 5000, 128}, {96, 128, 4096, 96}})
        c.push_back(head_cross_entropy_case(rows, dim, vocab, chunk));
    for (auto [m, n, k] : {std::array<int64_t, 3>{128, 128, 128}, {264, 392, 656}, {48, 256, 1024}})
        for (bool wgrad : {false, true}) c.push_back(fp8_gemm_case(m, n, k, wgrad));
    c.push_back(fp8_grouped_case({0, 300, 300, 517, 700}, 760, 296, 656));
    c.push_back(fp8_grouped_case({0, 128, 256, 384, 512, 640, 768, 896, 1024}, 1024, 512, 256));
    return c;
}

class OpCases : public CudaSessionTest, public ::testing::WithParamInterface<size_t> {};

TEST_P(OpCases, CudaMatchesTheCpuReference) {
    const OpCase c = op_cases()[GetParam()];
    c.run(*session_, c.name, c.tol);
}

INSTANTIATE_TEST_SUITE_P(Table, OpCases, ::testing::Range<size_t>(0, op_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                             std::string n = op_cases()[info.param].name;
                             for (char& ch : n)
                                 if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                             return n;
                         });

}  // namespace

#endif  // SPARSETRON_WITH_CUDA
