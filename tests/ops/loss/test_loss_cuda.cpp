// The loss family on CUDA against the CPU reference: the fused head + cross-entropy, the
// softmax rows and the MTP TV loss's pieces.
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
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/loss/loss.h"

#if SPARSETRON_WITH_CUDA
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(LossCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The loss family's CUDA tests: the shared op fixture (op_fixtures.h).
class LossCuda : public CudaOps {};

namespace {
void head_cross_entropy_check(const cuda::CudaSession& session, int64_t vocab,
                              int64_t dlogits_rows);
}  // namespace

// A vocabulary that is a multiple of 4 (16-byte sweeps over the logits) and one that is not;
// dlogits for all 150 rows (one weight-gradient GEMM) and for two chunks of 64 (two GEMMs, the
// second over the last 22 rows, accumulating onto the first's).
TEST_F(LossCuda, HeadCrossEntropyChunked) {
    head_cross_entropy_check(*session_, 1000, 150);
    head_cross_entropy_check(*session_, 998, 150);
    head_cross_entropy_check(*session_, 1000, 128);
}

namespace {
// A head_cross_entropy call's arguments but the gradient's type and the FP8 form.
cuda::HeadLoss head_args(const bf16* h, int64_t rows, int64_t dim, const bf16* w, int64_t vocab,
                         const int32_t* targets, int64_t chunk, float* logits, bf16* dlogits,
                         int64_t dlogits_rows, float grad_scale) {
    return {.h = h,
            .rows = rows,
            .dim = dim,
            .w = w,
            .vocab = vocab,
            .targets = targets,
            .chunk_rows = chunk,
            .logits_ws = logits,
            .dlogits_ws = dlogits,
            .dlogits_rows = dlogits_rows,
            .grad_scale = grad_scale};
}

void head_cross_entropy_check(const cuda::CudaSession& session, int64_t vocab,
                              int64_t dlogits_rows) {
    SCOPED_TRACE(cat("vocab ", vocab, ", dlogits rows ", dlogits_rows));
    const ExecContext& ctx = session.ctx();
    const int64_t rows = 150, dim = 64, chunk = 64;
    Rounded h(rows * dim, 61), w(vocab * dim, 62, 0.5);
    std::vector<int32_t> tgt(rows);
    for (int64_t r = 0; r < rows; ++r) tgt[r] = r % 9 == 4 ? -1 : int32_t((r * 131) % vocab);
    DeviceArray<int32_t> dtgt(tgt);
    DeviceArray<float> logits(chunk * vocab), row_loss(rows);
    DeviceArray<bf16> dlogits(dlogits_rows * vocab), dh(rows * dim);
    auto dw0 = random_vector<float>(vocab * dim, 63, 0.01);
    DeviceArray<float> dw(dw0);
    DeviceArray<double> total(2);
    const float gs = 1.f / 133.f;
    const cuda::HeadLoss args =
        head_args(h.dev, rows, dim, w.dev, vocab, dtgt, chunk, logits, dlogits, dlogits_rows, gs);
    cuda::head_cross_entropy(ctx, args, row_loss, dh, dw);
    cuda::loss_sum(ctx, row_loss, dtgt, rows, total);
    session.synchronize();
    std::vector<float> lws(chunk * vocab), dhr(rows * dim), dwr = dw0;
    double loss = 0;
    int64_t count = 0;
    cpu::head_cross_entropy<float>(h.host.data(), rows, dim, w.host.data(), vocab, tgt.data(),
                                   chunk, lws.data(), gs, dhr.data(), dwr.data(), &loss, &count);
    auto t = total.download();
    std::cout << "[harness] head loss sum (vocab " << vocab << ") gpu " << t[0] << " cpu " << loss
              << "\n";
    EXPECT_NEAR(t[0], loss, 1e-5 * std::fabs(loss));
    EXPECT_EQ(int64_t(t[1]), count);
    expect_close("head dh", download_f(dh), dhr, kBf16Tol);
    // dw is an fp32 sum of bf16-rounded dlogits: the rounding of dlogits bounds its error.
    std::vector<float> dw_delta = dw.download(), dwr_delta = dwr;
    for (int64_t i = 0; i < vocab * dim; ++i) dw_delta[i] -= dw0[i], dwr_delta[i] -= dw0[i];
    expect_close("head dw (increment)", dw_delta, dwr_delta, kBf16Tol);
    // Into a bf16 gradient (bf16 gradient buffers): the same sum added to it, rounded to bf16.
    std::vector<bf16> dw0_16(dw0.size());
    for (size_t i = 0; i < dw0.size(); ++i) dw0_16[i] = float_to_bf16(dw0[i]);
    DeviceArray<bf16> dw16(dw0_16);
    cuda::HeadLoss args16 = args;
    args16.dw_type = DType::BF16;
    cuda::head_cross_entropy(ctx, args16, row_loss, nullptr, dw16);
    session.synchronize();
    expect_close("head dw (bf16 gradient)", download_f(dw16), dwr, 4e-3);
    expect_guard(dlogits, "head dlogits");
    expect_guard(dh, "head dh");
    expect_guard(dw, "head dw");
    expect_guard(dw16, "head dw (bf16)");
}
}  // namespace

namespace {
// The head's GEMMs in FP8 blockwise (fp8_output_proj: W and W^T quantized 128x128, the operands
// 1x128) against the fp32 CPU reference: the loss, dh and dw (into fp32 and into a bf16 gradient)
// within e4m3's error (3 mantissa bits: a few percent of each result's norm, where a GEMM on a
// wrong layout or scale is off by its whole norm), the weight gradient in groups of
// `dlogits_rows`.
void head_cross_entropy_fp8_check(const cuda::CudaSession& session, int64_t dlogits_rows) {
    SCOPED_TRACE(cat("FP8 head, dlogits rows ", dlogits_rows));
    const ExecContext& ctx = session.ctx();
    const int64_t rows = 144, dim = 256, chunk = 48, vocab = 1024;
    Rounded h(rows * dim, 71), w(vocab * dim, 72, 0.5);
    std::vector<int32_t> tgt(rows);
    for (int64_t r = 0; r < rows; ++r) tgt[r] = r % 9 == 4 ? -1 : int32_t((r * 131) % vocab);
    DeviceArray<int32_t> dtgt(tgt);
    DeviceArray<float> logits(chunk * vocab), row_loss(rows), w32(w.host);
    DeviceArray<bf16> dlogits(dlogits_rows * vocab), dh(rows * dim);
    DeviceArray<double> total(2);
    // W and W^T in FP8 (the model quantizes its head's master so every forward).
    DeviceArray<uint8_t> wq(vocab * dim), wqt(vocab * dim);
    DeviceArray<float> ws(fp8::scales_128x128(vocab, dim)), wst(fp8::scales_128x128(dim, vocab));
    cuda::quantize_fp8_128x128_both(ctx, w32, vocab, dim, true, wq, ws, wqt, wst);
    const cuda::HeadFp8Scratch f = cuda::head_fp8_scratch(chunk, dlogits_rows, dim, vocab);
    DeviceArray<uint8_t> qa(f.qa), qb(f.qb);
    DeviceArray<float> sa(f.sa), sb(f.sb);
    const cuda::HeadFp8 fp8{
        .w = {wq, ws, true}, .wt = {wqt, wst, true}, .qa = qa, .qb = qb, .sa = sa, .sb = sb};
    const float gs = 1.f / 133.f;
    std::vector<float> lws(chunk * vocab), dhr(rows * dim), dwr(vocab * dim, 0.f);
    double loss = 0;
    int64_t count = 0;
    cpu::head_cross_entropy<float>(h.host.data(), rows, dim, w.host.data(), vocab, tgt.data(),
                                   chunk, lws.data(), gs, dhr.data(), dwr.data(), &loss, &count);
    for (const DType dw_type : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(dw_type == DType::F32 ? "fp32 dw" : "bf16 dw");
        DeviceArray<float> dw32(vocab * dim);
        DeviceArray<bf16> dw16(vocab * dim);
        void* dw = dw_type == DType::F32 ? static_cast<void*>(dw32) : static_cast<void*>(dw16);
        // W is read through its FP8 copies only; dw is written (its old values not read).
        cuda::HeadLoss args = head_args(h.dev, rows, dim, nullptr, vocab, dtgt, chunk, logits,
                                        dlogits, dlogits_rows, gs);
        args.dw_beta = 0.f, args.dw_type = dw_type, args.fp8 = &fp8;
        cuda::head_cross_entropy(ctx, args, row_loss, dh, dw);
        cuda::loss_sum(ctx, row_loss, dtgt, rows, total);
        session.synchronize();
        const auto t = total.download();
        std::cout << "[harness] FP8 head loss sum gpu " << t[0] << " cpu " << loss << "\n";
        EXPECT_NEAR(t[0], loss, 1e-2 * std::fabs(loss));
        EXPECT_EQ(int64_t(t[1]), count);
        expect_close("FP8 head dh", download_f(dh), dhr, 8e-2);
        expect_close("FP8 head dw", dw_type == DType::F32 ? dw32.download() : download_f(dw16), dwr,
                     8e-2);
        expect_guard(dlogits, "FP8 head dlogits");
        expect_guard(qa, "FP8 head operand a");
        expect_guard(qb, "FP8 head operand b");
        expect_guard(sa, "FP8 head operand a scales");
        expect_guard(sb, "FP8 head operand b scales");
    }
}
}  // namespace

// All rows' dlogits in one weight-gradient GEMM, and in groups of two chunks (the second group
// one chunk).
TEST_F(LossCuda, HeadCrossEntropyFp8) {
    head_cross_entropy_fp8_check(*session_, 144);
    head_cross_entropy_fp8_check(*session_, 96);
}

// Both softmax kernels: 704 columns take the 16-byte online one, 701 the three-pass one.
TEST_F(LossCuda, SoftmaxRowsBothKernels) {
    for (const int64_t V : {int64_t(704), int64_t(701)}) {
        SCOPED_TRACE(cat("vocab ", V));
        const int64_t rows = 37;
        auto z = random_vector<float>(rows * V, 143, 6.0);
        DeviceArray<float> dz(z);
        cuda::softmax_rows(ctx(), dz, rows, V);
        sync();
        std::vector<float> ref(rows * V);
        for (int64_t r = 0; r < rows; ++r) {
            double mx = -INFINITY, s = 0;
            for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(z[r * V + v]));
            for (int64_t v = 0; v < V; ++v) s += std::exp(double(z[r * V + v]) - mx);
            for (int64_t v = 0; v < V; ++v)
                ref[r * V + v] = float(std::exp(double(z[r * V + v]) - mx) / s);
        }
        expect_close("softmax rows", dz.download(), ref, 1e-5);
    }
}

// Vocabularies of 700 take the 16-byte kernels, 701 the scalar ones.
TEST_F(LossCuda, MtpTvSoftmaxOverlapChainAndGradient) {
    for (const int64_t V : {int64_t(700), int64_t(701)}) {
        SCOPED_TRACE(cat("vocab ", V));
        const int64_t rows = 60, D = 3, T = rows;
        auto zp = random_vector<float>(rows * V, 141, 4.0),
             zq = random_vector<float>(rows * V, 142, 4.0);
        DeviceArray<float> p(zp), q(zq), alpha(D * T), below(D * T), dalpha(D * T);
        DeviceArray<double> sums(2);
        std::vector<uint8_t> valid(T);
        for (int64_t i = 0; i < T; ++i) valid[i] = i % 7 != 3;
        DeviceArray<uint8_t> dvalid(valid);
        auto soft = [&](const std::vector<float>& z, int64_t r) {
            std::vector<double> out(V);
            double mx = -INFINITY, s = 0;
            for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(z[r * V + v]));
            for (int64_t v = 0; v < V; ++v) s += out[v] = std::exp(double(z[r * V + v]) - mx);
            for (auto& x : out) x /= s;
            return out;
        };
        cuda::softmax_rows(ctx(), p, rows, V);
        cuda::tv_draft_softmax_overlap(ctx(), p, q, rows, V, alpha, below);  // depth 0
        sync();
        auto a0 = alpha.download(), s0 = below.download(), qs = q.download();
        std::vector<float> aref(rows), sref(rows), qref(rows * V);
        for (int64_t r = 0; r < rows; ++r) {
            auto pr = soft(zp, r), qr = soft(zq, r);
            double a = 0, sb = 0;
            for (int64_t v = 0; v < V; ++v) {
                a += std::min(pr[v], qr[v]);
                sb += qr[v] <= pr[v] ? qr[v] : 0.0;
                qref[r * V + v] = float(qr[v]);
            }
            aref[r] = float(a), sref[r] = float(sb);
        }
        a0.resize(rows), s0.resize(rows);
        expect_close("draft softmax", qs, qref, 1e-5);
        expect_close("tv overlap", a0, aref, 1e-5);
        expect_close("tv sum of draft below target", s0, sref, 1e-5);
        // Chain over three depths with given α.
        std::vector<float> al(D * T);
        for (int64_t i = 0; i < D * T; ++i) al[i] = 0.3f + 0.6f * float((i * 37) % 11) / 11.f;
        alpha.upload(al);
        cuda::zero(ctx(), sums, 2 * sizeof(double));
        cuda::tv_chain(ctx(), alpha, dvalid, D, T, T, 0.25f, dalpha, sums);
        sync();
        std::vector<float> dar(D * T, 0.f);
        double loss = 0, acc = 0;
        for (int64_t i = 0; i < T; ++i) {
            if (!valid[i]) continue;
            double prod = 1;
            for (int64_t k = 0; k < D; ++k)
                prod *= al[k * T + i], loss += (1 - prod) / D, acc += prod;
            // ∂L/∂α_d by central differences of the chain loss.
            for (int64_t d = 0; d < D; ++d) {
                auto L = [&](double delta) {
                    double pr = 1, l = 0;
                    for (int64_t k = 0; k < D; ++k)
                        pr *= al[k * T + i] + (k == d ? delta : 0), l += (1 - pr) / D;
                    return l;
                };
                dar[d * T + i] = float((L(1e-4) - L(-1e-4)) / 2e-4 * 0.25);
            }
        }
        auto s = sums.download();
        EXPECT_NEAR(s[0], loss, 1e-9 * loss + 1e-9);
        EXPECT_NEAR(s[1], acc, 1e-9 * acc);
        expect_close("tv chain dalpha (vs central differences)", dalpha.download(), dar, 1e-5);
        // Logit gradient: dz = -dα q (s - 1 + 1[q > p]) with s = Σ_{q <= p} q.
        DeviceArray<bf16> dz(rows * V);
        cuda::tv_logit_grad(ctx(), p, q, dalpha, below, rows, V, dz);
        sync();
        std::vector<float> dzr(rows * V);
        for (int64_t r = 0; r < rows; ++r) {
            auto pr = soft(zp, r), qr = soft(zq, r);
            for (int64_t v = 0; v < V; ++v)
                dzr[r * V + v] = float(-dar[r] * qr[v] * (sref[r] - 1 + (qr[v] > pr[v] ? 1 : 0)));
        }
        std::vector<bool> mask(rows * V);
        for (int64_t i = 0; i < rows * V; ++i) mask[i] = valid[i / V];
        expect_close("tv logit gradient", download_f(dz), dzr, kBf16Tol, mask);
    }
}

#endif  // SPARSETRON_WITH_CUDA
