// Every CUDA op against the CPU reference on fresh random data (label gpu). Tolerances: outputs
// stored in bf16 are compared at 1e-2 normalized error (bf16 keeps 8 bits: one rounding of a
// value is up to 2^-9 relative); fp32 outputs computed from the same bf16 inputs at 1e-5..1e-4
// (only the order of fp32 additions differs); integer outputs (top-k, routing) exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <numeric>

#include "harness.h"
#include "sparsetron/cuda/device_caps.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/loss/loss.h"
#include "sparsetron/ops/moe/grouped_gemm_forms.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/ops/moe/paged_stash.h"
#include "sparsetron/ops/norm/norm.h"
#include "sparsetron/ops/optim/optim.h"

#if SPARSETRON_WITH_CUDA
#include "cuda_session_test.h"
#include "sparsetron/cuda/cuda_session.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaOps, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op harness runs on the GPU machine";
}
#else

namespace {

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
    std::vector<int32_t> row_begin(int64_t tokens) const {
        std::vector<int32_t> rb(tokens, -1);
        for (int d = 0; d < num_docs; ++d)
            for (int32_t t = cu[d]; t < cu[d + 1]; ++t) rb[t] = cu[d];
        return rb;
    }
};

std::vector<float> download_f(const DeviceArray<bf16>& a) {
    return to_float(a.download());
}

class CudaOps : public CudaSessionTest {};

}  // namespace

TEST_F(CudaOps, GemmAllTransposesAndTypes) {
    for (uint64_t seed : {1, 2}) {
        const int64_t m = 97, n = 130, k = 75;
        for (int ta = 0; ta < 2; ++ta)
            for (int tb = 0; tb < 2; ++tb) {
                const int64_t lda = ta ? m + 3 : k + 5, ldb = tb ? k + 2 : n + 1, ldc = n + 4;
                Rounded a((ta ? k : m) * lda, seed * 10 + 1), b((tb ? n : k) * ldb, seed * 10 + 2);
                auto c0 = random_vector<float>(m * ldc, seed * 10 + 3);
                // fp32 output accumulating into C (beta = 1), and a bf16 output.
                DeviceArray<float> c32(c0);
                cuda::gemm(ctx(), ta, tb, m, n, k, 0.5f, a.dev, lda, b.dev, ldb, 1.f, c32, ldc,
                           DType::BF16, DType::F32);
                DeviceArray<bf16> c16(m * ldc);
                cuda::gemm(ctx(), ta, tb, m, n, k, 1.f, a.dev, lda, b.dev, ldb, 0.f, c16, ldc);
                sync();
                std::vector<float> ref32 = c0, ref16(m * ldc, 0.f);
                cpu::gemm<float>(ta, tb, m, n, k, 0.5f, a.host.data(), lda, b.host.data(), ldb, 1.f,
                                 ref32.data(), ldc);
                cpu::gemm<float>(ta, tb, m, n, k, 1.f, a.host.data(), lda, b.host.data(), ldb, 0.f,
                                 ref16.data(), ldc);
                std::vector<bool> in_c(m * ldc);
                for (int64_t i = 0; i < m * ldc; ++i) in_c[i] = i % ldc < n;
                const std::string tag = cat("gemm ta=", ta, " tb=", tb);
                expect_close(tag + " bf16->fp32 beta=1", c32.download(), ref32, kF32Tol, in_c);
                expect_close(tag + " bf16->bf16", download_f(c16), ref16, kBf16Tol, in_c);
                expect_guard(c32, tag);
                expect_guard(c16, tag);
            }
    }
}

TEST_F(CudaOps, GemmFp32AndBatched) {
    const int64_t m = 40, n = 56, k = 33, batch = 3;
    auto a = random_vector<float>(batch * m * k, 5), b = random_vector<float>(batch * n * k, 6);
    DeviceArray<float> da(a), db(b), dc(batch * m * n);
    cuda::gemm(ctx(), false, true, m, n, k, 1.f, da, k, db, k, 0.f, dc, n, DType::F32, DType::F32,
               {batch, m * k, n * k, m * n});
    sync();
    std::vector<float> ref(batch * m * n);
    for (int64_t i = 0; i < batch; ++i)
        cpu::gemm<float>(false, true, m, n, k, 1.f, a.data() + i * m * k, k, b.data() + i * n * k,
                         k, 0.f, ref.data() + i * m * n, n);
    expect_close("gemm fp32 batched", dc.download(), ref, kF32Tol);
    expect_guard(dc, "gemm batched");
}

// fp32 GEMMs exact and with TF32 tensor cores (Muon's muon_fp32_matmul_prec): the TF32 error
// against the fp32 CPU GEMM must be TF32-sized (10-bit mantissa inputs), the exact mode's
// fp32-sized, so a mode that is not applied fails. Measured on the H200: 2.3e-7 and 2.6e-4.
TEST_F(CudaOps, GemmFp32PrecisionModes) {
    const int64_t m = 96, n = 128, k = 512;
    auto a = random_vector<float>(m * k, 51), b = random_vector<float>(n * k, 52);
    DeviceArray<float> da(a), db(b), dc(m * n);
    std::vector<float> ref(m * n);
    cpu::gemm<float>(false, true, m, n, k, 1.f, a.data(), k, b.data(), k, 0.f, ref.data(), n);
    auto error = [&](bool tf32) {
        cuda::GemmBatch g;
        g.tf32 = tf32;
        cuda::gemm(ctx(), false, true, m, n, k, 1.f, da, k, db, k, 0.f, dc, n, DType::F32,
                   DType::F32, g);
        sync();
        const auto got = dc.download();
        double num = 0, den = 0;
        for (size_t i = 0; i < ref.size(); ++i)
            num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]),
                den += double(ref[i]) * ref[i];
        return std::sqrt(num / den);
    };
    const double exact = error(false), tf32 = error(true);
    std::cout << "[harness] fp32 GEMM normalized error: fp32 " << exact << ", tf32 " << tf32
              << "\n";
    EXPECT_LT(exact, 1e-6);
    EXPECT_GT(tf32, 1e-5);
    EXPECT_LT(tf32, 2e-3);
}

TEST_F(CudaOps, Embedding) {
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
}

TEST_F(CudaOps, RmsNormForwardBackwardStrided) {
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
TEST_F(CudaOps, RmsNormVectorRows) {
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

TEST_F(CudaOps, LayerNormForwardBackward) {
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

TEST_F(CudaOps, RopeBothPairingsAndInverse) {
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
TEST_F(CudaOps, SwiGlu) {
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

namespace {
void head_cross_entropy_check(const cuda::CudaSession& session, int64_t vocab);
}  // namespace

// A vocabulary that is a multiple of 4 (16-byte sweeps over the logits) and one that is not.
TEST_F(CudaOps, HeadCrossEntropyChunked) {
    head_cross_entropy_check(*session_, 1000);
    head_cross_entropy_check(*session_, 998);
}

namespace {
void head_cross_entropy_check(const cuda::CudaSession& session, int64_t vocab) {
    const ExecContext& ctx = session.ctx();
    const int64_t rows = 150, dim = 64, chunk = 64;
    Rounded h(rows * dim, 61), w(vocab * dim, 62, 0.5);
    std::vector<int32_t> tgt(rows);
    for (int64_t r = 0; r < rows; ++r) tgt[r] = r % 9 == 4 ? -1 : int32_t((r * 131) % vocab);
    DeviceArray<int32_t> dtgt(tgt);
    DeviceArray<float> logits(chunk * vocab), row_loss(rows);
    DeviceArray<bf16> dlogits(rows * vocab), dh(rows * dim);  // all rows: dw is one GEMM
    auto dw0 = random_vector<float>(vocab * dim, 63, 0.01);
    DeviceArray<float> dw(dw0);
    DeviceArray<double> total(2);
    const float gs = 1.f / 133.f;
    cuda::head_cross_entropy(ctx,
                             {.h = h.dev,
                              .rows = rows,
                              .dim = dim,
                              .w = w.dev,
                              .vocab = vocab,
                              .targets = dtgt,
                              .chunk_rows = chunk,
                              .logits_ws = logits,
                              .dlogits_ws = dlogits,
                              .grad_scale = gs},
                             row_loss, dh, dw);
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
    expect_guard(dh, "head dh");
    expect_guard(dw, "head dw");
}
}  // namespace

TEST_F(CudaOps, DenseAttentionForwardBackward) {
    const Docs docs;
    const int64_t T = 200, H = 4, dqk = 48, dv = 32;
    // q, k, v inside wider rows (the MLA projections' layout) to exercise the strides.
    const int64_t q_st = H * dqk + 8, k_st = H * (dqk + dv), v_st = k_st;
    cpu::AttnShape cs{T, H, dqk, dv, q_st, dqk, k_st, dqk + dv, v_st, dqk + dv};
    Rounded q(T * q_st, 71), kv(T * k_st, 72), dout(T * H * dv, 73);
    const bf16* k = kv.dev.get();
    const bf16* v = kv.dev.get() + dqk;
    DeviceArray<int32_t> rb(docs.row_begin(T));
    DeviceArray<bf16> out(T * H * dv), dq(T * q_st);
    DeviceArray<float> lse(H * T), dk(T * H * dqk), dvv(T * H * dv);
    const float scale = 1.f / std::sqrt(float(dqk));
    cuda::AttnShape s{T, H, dqk, dv, q_st, dqk, k_st, dqk + dv, v_st, dqk + dv};
    cuda::attention_forward(ctx(), s, q.dev, k, v, rb, scale, out, lse);
    cuda::attention_backward(ctx(), s, q.dev, k, v, out, lse, dout.dev, rb, scale, dq, dk, dvv);
    sync();
    std::vector<float> o(T * H * dv), l(H * T), dqr(T * q_st, 0.f), dkvr(T * k_st, 0.f);
    std::vector<float> dvr(T * k_st, 0.f);
    cpu::attention_forward<float>(cs, q.host.data(), kv.host.data(), kv.host.data() + dqk,
                                  docs.cu.data(), docs.num_docs, scale, o.data(), l.data());
    // The CPU backward reads the GPU's (bf16) output so both differentiate the same forward.
    auto o_gpu = download_f(out);
    cpu::attention_backward<float>(cs, q.host.data(), kv.host.data(), kv.host.data() + dqk,
                                   o_gpu.data(), l.data(), dout.host.data(), docs.cu.data(),
                                   docs.num_docs, scale, dqr.data(), dkvr.data(), dvr.data() + dqk);
    std::vector<float> dk_ref(T * H * dqk), dv_ref(T * H * dv);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t i = 0; i < dqk; ++i)
                dk_ref[(t * H + h) * dqk + i] = dkvr[t * k_st + h * (dqk + dv) + i];
            for (int64_t i = 0; i < dv; ++i)
                dv_ref[(t * H + h) * dv + i] = dvr[t * k_st + h * (dqk + dv) + dqk + i];
        }
    std::vector<bool> in_q(T * q_st);
    for (int64_t i = 0; i < T * q_st; ++i) in_q[i] = i % q_st < H * dqk && i / q_st < 180;
    expect_close("attention out", o_gpu, o, kBf16Tol);
    expect_close("attention lse", lse.download(), l, 1e-5);
    expect_close("attention dq", download_f(dq), dqr, kBf16Tol, in_q);
    expect_close("attention dk", dk.download(), dk_ref, kBf16Tol);
    expect_close("attention dv", dvv.download(), dv_ref, kBf16Tol);
    expect_guard(out, "attention out");
    expect_guard(dvv, "attention dv");
}

namespace {
// masked_chunks > 0: run the masked-dense implementation with a workspace that holds about
// T / masked_chunks query tokens (several chunks: the chunk offsets are exercised), instead of
// the gathered one. saved_probs: the forward keeps every chunk's probabilities and the backward
// reads them instead of recomputing scores and probabilities.
void sparse_mqa_check(const cuda::CudaSession& session, int64_t H, int64_t dqk, int64_t dv,
                      int64_t K, const std::string& tag, int masked_chunks = 0,
                      bool saved_probs = false);
}  // namespace

TEST_F(CudaOps, SparseMqaForwardBackward) {
    sparse_mqa_check(*session_, 8, 72, 64, 32, "sparse mqa");
}

// The GLM-5 shape (64 heads, latent 512 + rope 64): on sm_90 the flash wgmma forward and backward
// through sparse_mqa_forward / sparse_mqa_backward; with 32 heads the tensor-core kernels.
TEST_F(CudaOps, SparseMqaGatheredAtTheGlm5Shape) {
    sparse_mqa_check(*session_, 64, 576, 512, 96, "sparse mqa (flash wgmma on sm_90)");
    sparse_mqa_check(*session_, 32, 576, 512, 96, "sparse mqa (tensor cores, 32 heads)");
}

// The masked-dense implementation (cuBLASLt scores against every earlier key, top-k as a mask).
TEST_F(CudaOps, SparseMqaMaskedDense) {
    sparse_mqa_check(*session_, 8, 72, 64, 32, "sparse mqa (masked, one chunk)", 1);
    // 12 heads: the backward's second group of 8 heads is partial.
    sparse_mqa_check(*session_, 12, 72, 64, 32, "sparse mqa (masked, 3 chunks, 12 heads)", 3);
}
TEST_F(CudaOps, SparseMqaMaskedDenseAtTheGlm5Shape) {
    sparse_mqa_check(*session_, 64, 576, 512, 96, "sparse mqa (masked, GLM-5 shape)", 2);
}
// Saved probabilities: one chunk, 3 chunks with a partial head group, the GLM-5 shape.
TEST_F(CudaOps, SparseMqaMaskedDenseWithSavedProbabilities) {
    sparse_mqa_check(*session_, 8, 72, 64, 32, "sparse mqa (masked, saved P, one chunk)", 1, true);
    sparse_mqa_check(*session_, 12, 72, 64, 32, "sparse mqa (masked, saved P, 3 chunks)", 3, true);
    sparse_mqa_check(*session_, 64, 576, 512, 96, "sparse mqa (masked, saved P, GLM-5 shape)", 2,
                     true);
}

namespace {
void sparse_mqa_check(const cuda::CudaSession& session, int64_t H, int64_t dqk, int64_t dv,
                      int64_t K, const std::string& tag, int masked_chunks, bool saved_probs) {
    const ExecContext& ctx = session.ctx();
    const Docs docs;
    const int64_t T = 200;
    Rounded q(T * H * dqk, 81), kv(T * dqk, 82), dout(T * H * dv, 83);
    // Each row picks an ascending random subset of its causal document keys; padding rows none.
    auto rbv = docs.row_begin(T);
    std::vector<int32_t> idx(T * K, -1), len(T, 0);
    CounterRng rng(84, 1);
    uint64_t draw = 0;
    for (int64_t t = 0; t < T; ++t) {
        if (rbv[t] < 0) continue;
        std::vector<int32_t> cand(t - rbv[t] + 1);
        std::iota(cand.begin(), cand.end(), rbv[t]);
        for (size_t i = cand.size(); i > 1; --i) std::swap(cand[i - 1], cand[rng.bits(draw++) % i]);
        const int64_t n = std::min<int64_t>(K, int64_t(cand.size()));
        std::sort(cand.begin(), cand.begin() + n);
        std::copy_n(cand.begin(), n, idx.begin() + t * K);
        len[t] = int32_t(n);
    }
    DeviceArray<int32_t> didx(idx), dlen(len);
    DeviceArray<bf16> out(T * H * dv), dq(T * H * dqk);
    DeviceArray<float> lse(H * T), dkv(T * dqk), psum(T * K);
    const float scale = float(0.9 / std::sqrt(double(dqk)));
    const bool masked = masked_chunks > 0;
    const int64_t planned = cuda::sparse_mqa_workspace_bytes(T, H, K);
    ASSERT_GT(planned, 0) << "the masked form applies when T <= 8 k";
    // Bytes per query token: S, dP (fp32) and P (bf16) rows of 16-rounded length, per head.
    const int64_t per_token = H * ((T + 15) / 16 * 16) * 10;
    ASSERT_EQ(planned, T * per_token) << "a short context fits one chunk";
    const int64_t ws_bytes = masked ? (T + masked_chunks - 1) / masked_chunks * per_token : 0;
    DeviceArray<float> workspace(std::max<int64_t>(1, (ws_bytes + 3) / 4));
    void* wsp = masked ? static_cast<void*>(static_cast<float*>(workspace)) : nullptr;
    // Saved probabilities: one [rows, 16-rounded keys] block per chunk of cq tokens.
    const int64_t saved_elems =
        saved_probs ? cuda::sparse_mqa_saved_probs_elems(T, H, ws_bytes) : 0;
    if (saved_probs) {
        ASSERT_TRUE(masked);
        const int64_t cq = (T + masked_chunks - 1) / masked_chunks;
        int64_t expect = 0;
        for (int64_t t0 = 0; t0 < T; t0 += cq)
            expect += (std::min(T, t0 + cq) - t0) * H * ((std::min(T, t0 + cq) + 15) / 16 * 16);
        ASSERT_EQ(saved_elems, expect) << tag;
    }
    DeviceArray<bf16> probs(std::max<int64_t>(1, saved_elems));
    bf16* pp = saved_probs ? static_cast<bf16*>(probs) : nullptr;
    const cuda::SparseMqa problem{T, H, dqk, dv, q.dev, kv.dev, didx, dlen, K, scale};
    cuda::sparse_mqa_forward(ctx, problem, out, lse, psum, {wsp, ws_bytes, pp});
    cuda::sparse_mqa_backward(ctx, problem, out, lse, dout.dev, dq, dkv, {wsp, ws_bytes, pp});
    session.synchronize();
    std::vector<float> o(T * H * dv), l(H * T), dqr(T * H * dqk), ws(H * T * dqk), dkvr(T * dqk);
    cpu::sparse_mqa_forward<float>(T, H, dqk, dv, q.host.data(), kv.host.data(), idx.data(),
                                   len.data(), K, scale, o.data(), l.data());
    auto o_gpu = download_f(out);
    cpu::sparse_mqa_backward<float>(T, H, dqk, dv, q.host.data(), kv.host.data(), idx.data(),
                                    len.data(), K, scale, o_gpu.data(), l.data(), dout.host.data(),
                                    dqr.data(), ws.data(), dkvr.data());
    expect_close(tag + " out", o_gpu, o, kBf16Tol);
    expect_close(tag + " lse", lse.download(), l, 1e-5);
    // Σ_h P per selected key (the indexer loss's teacher), in fp64 from the CPU lse.
    const auto pref = head_prob_sums(q.host, kv.host, idx, len, l, T, H, dqk, K, scale);
    expect_close(tag + " head probability sums", psum.download(), pref, 1e-4);
    expect_close(tag + " dq", download_f(dq), dqr, kBf16Tol);
    expect_close(tag + " dkv", dkv.download(), dkvr, kBf16Tol);
    expect_guard(out, tag + " out");
    expect_guard(dkv, tag + " dkv");
}
}  // namespace

TEST_F(CudaOps, IndexerScoresAndTopk) {
    const Docs docs;
    const int64_t T = 200, H = 4, d = 32, K = 16;
    Rounded q(T * H * d, 91), k(T * d, 92);
    auto w = random_vector<float>(T * H, 93);
    DeviceArray<float> dw(w), scores(T * T);
    auto rbv = docs.row_begin(T);
    DeviceArray<int32_t> rb(rbv), idx(T * K), len(T);
    // The simple kernel, then the GEMM form with the planned workspace (one chunk at this size)
    // and with one of 64 query rows (4 chunks, the last partial); the last one's scores are
    // checked, and each form's against the first.
    const int64_t planned = cuda::indexer_scores_workspace_bytes(T, H);
    ASSERT_EQ(planned, T * H * T * 4);
    DeviceArray<float> ws(planned / 4);
    cuda::indexer_scores(ctx(), q.dev, k.dev, dw, rb, T, H, d, scores);
    sync();
    const auto simple = scores.download();
    for (int64_t bytes : {planned, int64_t(64 * H * T * 4)}) {
        cuda::fill(ctx(), scores, T * T, -7.f);
        cuda::indexer_scores(ctx(), q.dev, k.dev, dw, rb, T, H, d, scores, ws, bytes);
        sync();
        std::vector<bool> in_rows(T * T, false);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t s = rbv[t]; rbv[t] >= 0 && s <= t; ++s) in_rows[t * T + s] = true;
        expect_close("indexer scores (GEMM form) vs simple", scores.download(), simple, 1e-5,
                     in_rows);
    }
    cuda::topk_rows(ctx(), scores, T, rb, T, K, idx, len);
    sync();
    auto sg = scores.download();
    std::vector<float> sref(T * T, 0.f);
    std::vector<bool> valid(T * T, false);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = rbv[t]; rbv[t] >= 0 && s <= t; ++s) {
            double acc = 0;
            for (int64_t j = 0; j < H; ++j) {
                double dot = 0;
                for (int64_t i = 0; i < d; ++i)
                    dot += double(q.host[(t * H + j) * d + i]) * k.host[s * d + i];
                acc += w[t * H + j] * std::max(dot, 0.0);
            }
            sref[t * T + s] = float(acc), valid[t * T + s] = true;
        }
    expect_close("indexer scores", sg, sref, 1e-5, valid);
    // Top-k of the GPU's own scores must follow the CPU rule exactly.
    auto ig = idx.download(), lg = len.download();
    int64_t wrong = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t n = rbv[t] < 0 ? 0 : t - rbv[t] + 1;
        std::vector<float> row(sg.begin() + t * T, sg.begin() + (t + 1) * T);
        auto ref = n ? reference_topk(row.data(), rbv[t], n, K) : std::vector<int32_t>(K, -1);
        wrong += !std::equal(ref.begin(), ref.end(), ig.begin() + t * K);
        wrong += lg[t] != std::min<int64_t>(K, n);
    }
    EXPECT_EQ(wrong, 0);
    expect_guard(idx, "topk idx");
}

TEST_F(CudaOps, TopkTiesGoToTheSmallerIndex) {
    // Scores from a handful of values: many exact ties straddle the k-th place.
    const int64_t T = 2100, K = 64;
    std::vector<float> s(T * T, 0.f);
    CounterRng rng(95, 2);
    for (size_t i = 0; i < s.size(); ++i) s[i] = float(int(rng.bits(i) % 7) - 3) * 0.5f;
    std::vector<int32_t> rbv(T);
    for (int64_t t = 0; t < T; ++t) rbv[t] = t < 1500 ? 0 : 1500;
    DeviceArray<float> ds(s);
    DeviceArray<int32_t> rb(rbv), idx(T * K), len(T);
    cuda::topk_rows(ctx(), ds, T, rb, T, K, idx, len);
    sync();
    auto ig = idx.download();
    int64_t wrong = 0;
    for (int64_t t = 0; t < T; ++t) {
        std::vector<float> row(s.begin() + t * T, s.begin() + (t + 1) * T);
        auto ref = reference_topk(row.data(), rbv[t], t - rbv[t] + 1, K);
        wrong += !std::equal(ref.begin(), ref.end(), ig.begin() + t * K);
    }
    EXPECT_EQ(wrong, 0);
}

TEST_F(CudaOps, RouterPermuteGatherCombine) {
    const Docs docs;
    const int64_t T = 200, E = 12, k = 3, capacity = 40;
    auto logits = random_vector<float>(T * E, 101, 3.0), bias = random_vector<float>(E, 102, 0.2);
    auto rbv = docs.row_begin(T);
    DeviceArray<float> dl(logits), db(bias), probs(T * E), gates(T * k);
    DeviceArray<int32_t> rb(rbv), topk(T * k), counts(E), offsets(E + 1), slot(T * k), perm(T * k);
    for (bool force : {false, true}) {
        cuda::router_topk(ctx(), dl, db, rb, T, E, k, force, 2.5f, probs, topk, gates);
        cuda::moe_permute(ctx(), topk, T, E, k, capacity, counts, offsets, slot, perm);
        sync();
        // Reference routing (moe.cpp's rule) on the same fp32 logits.
        auto pg = probs.download(), gg = gates.download();
        auto tg = topk.download();
        std::vector<float> pref(T * E), gref(T * k, 0.f);
        std::vector<int32_t> tref(T * k, -1);
        for (int64_t i = 0; i < T * E; ++i)
            pref[i] = float(1.0 / (1.0 + std::exp(-double(logits[i]))));
        for (int64_t t = 0; t < T; ++t) {
            if (rbv[t] < 0) continue;
            std::vector<int32_t> order(E);
            std::iota(order.begin(), order.end(), 0);
            const float* p = pg.data() + t * E;  // the GPU's probabilities: no tie flips
            std::partial_sort(order.begin(), order.begin() + k, order.end(),
                              [&](int32_t x, int32_t y) {
                                  float vx = p[x] + bias[x], vy = p[y] + bias[y];
                                  return vx > vy || (vx == vy && x < y);
                              });
            for (int64_t j = 0; j < k; ++j)
                tref[t * k + j] = force ? int32_t((t * k + j) % E) : order[j];
            double sum = 1e-20;
            for (int64_t j = 0; j < k; ++j) sum += p[tref[t * k + j]];
            for (int64_t j = 0; j < k; ++j) gref[t * k + j] = float(p[tref[t * k + j]] / sum * 2.5);
        }
        expect_close(cat("router probs force=", force), pg, pref, 1e-6);
        EXPECT_EQ(tg, tref) << "router top-k, force=" << force;
        expect_close(cat("router gates force=", force), gg, gref, 1e-6);
        // Permutation: expert-major, token order within an expert, capacity drops the rest.
        std::vector<int32_t> cref(E, 0), oref(E + 1, 0), sref(T * k, -1), permref;
        for (int64_t i = 0; i < T * k; ++i)
            if (tref[i] >= 0) ++cref[tref[i]];
        for (int64_t e = 0; e < E; ++e)
            oref[e + 1] = oref[e] + std::min<int32_t>(cref[e], capacity);
        permref.assign(oref[E], -1);
        std::vector<int32_t> fill(oref.begin(), oref.end() - 1);
        for (int64_t i = 0; i < T * k; ++i) {
            const int32_t e = tref[i];
            if (e >= 0 && fill[e] < oref[e + 1])
                sref[i] = fill[e], permref[fill[e]++] = int32_t(i / k);
        }
        EXPECT_EQ(counts.download(), cref);
        EXPECT_EQ(offsets.download(), oref);
        EXPECT_EQ(slot.download(), sref);
        auto pgm = perm.download();
        EXPECT_TRUE(std::equal(permref.begin(), permref.end(), pgm.begin()));
        if (!force) {
            EXPECT_GT(oref[E], 0);
        }
        // Gather and combine: rows of 40 (the 16-byte vector kernels) and of 36 (the scalar ones).
        for (const int64_t gdim : {int64_t(40), int64_t(36)}) {
            SCOPED_TRACE(cat("dim ", gdim));
            Rounded x(T * gdim, 103), outp(T * k * gdim, 104), y0(T * gdim, 105);
            DeviceArray<bf16> xp(T * k * gdim);
            cuda::moe_gather(ctx(), x.dev, perm, offsets, E, T * k, gdim, xp);
            cuda::moe_combine(ctx(), outp.dev, slot, gates, T, k, gdim, y0.dev);
            sync();
            auto xpg = download_f(xp);
            std::vector<float> xpr(oref[E] * gdim);
            for (int32_t r = 0; r < oref[E]; ++r)
                std::copy_n(x.host.begin() + permref[r] * gdim, gdim, xpr.begin() + r * gdim);
            xpg.resize(oref[E] * gdim);
            expect_close("moe gather", xpg, xpr, 1e-7);
            std::vector<float> yr = y0.host;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < k; ++j)
                    if (sref[t * k + j] >= 0)
                        for (int64_t c = 0; c < gdim; ++c)
                            yr[t * gdim + c] +=
                                gg[t * k + j] * outp.host[sref[t * k + j] * gdim + c];
            expect_close("moe combine", download_f(y0.dev), yr, kBf16Tol);
        }
    }
}

namespace {
// A grouped GEMM's row operand: `rows` random rows of `width`, then `pad` rows of NaN. The buffer's
// capacity is rows + pad; the kernels' tile loads read past an expert's last row, and nothing
// they read past offsets[E] may reach an output (the weight gradient's reduction included).
Rounded nan_padded_rows(int64_t rows, int64_t pad, int64_t width, uint64_t seed) {
    std::vector<float> v = random_vector<float>(rows * width, seed);
    v.resize((rows + pad) * width, std::numeric_limits<float>::quiet_NaN());
    return Rounded(std::move(v));
}
constexpr int64_t kNanPad = 72;  // more than a 64-row slice, not a multiple of it

// Each kind against per-expert CPU GEMMs. Uneven experts (one empty), rows of some expert up to the
// bound; RowsTimesWeightT runs twice, the second time accumulating into its own output. The weight
// gradient is written over NaN (nothing may read the old gradient; the empty expert gets zeros),
// then added to: twice the product.
void grouped_gemm_check(const cuda::CudaSession& session, const std::vector<int32_t>& off,
                        int64_t n, int64_t kk, int64_t max_rows, const std::string& tag) {
    const ExecContext& ctx = session.ctx();
    const int64_t E = int64_t(off.size()) - 1, R = off.back(), cap = R + kNanPad;
    DeviceArray<int32_t> doff(off);
    Rounded w(E * n * kk, 111, 0.3);
    Rounded x = nan_padded_rows(R, kNanPad, kk, 112), dy = nan_padded_rows(R, kNanPad, n, 113);
    DeviceArray<bf16> y(R * n), dx(R * kk);
    DeviceArray<float> dw(std::vector<float>(E * n * kk, std::numeric_limits<float>::quiet_NaN()));
    using K2 = cuda::GroupedGemm;
    auto args = [&](K2 kind, const bf16* a, const bf16* b, void* c, bool acc) {
        return cuda::GroupedGemmArgs{kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc};
    };
    cuda::grouped_gemm(ctx, args(K2::RowsTimesWeightT, x.dev, w.dev, y, false));
    cuda::grouped_gemm(ctx, args(K2::RowsTimesWeightT, x.dev, w.dev, y, /*acc=*/true));
    cuda::grouped_gemm(ctx, args(K2::RowsTimesWeight, dy.dev, w.dev, dx, false));
    cuda::grouped_gemm(ctx, args(K2::WeightGrad, dy.dev, x.dev, dw, false));
    session.synchronize();
    const std::vector<float> dw_written = dw.download();
    cuda::grouped_gemm(ctx, args(K2::WeightGrad, dy.dev, x.dev, dw, /*acc=*/true));
    session.synchronize();
    std::vector<float> yr(R * n), dxr(R * kk), dwr(E * n * kk, 0.f);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = off[e], m = off[e + 1] - off[e];
        if (m == 0) continue;
        const float* we = w.host.data() + e * n * kk;
        cpu::gemm<float>(false, true, m, n, kk, 2.f, x.host.data() + r0 * kk, kk, we, kk, 0.f,
                         yr.data() + r0 * n, n);
        cpu::gemm<float>(false, false, m, kk, n, 1.f, dy.host.data() + r0 * n, n, we, kk, 0.f,
                         dxr.data() + r0 * kk, kk);
        cpu::gemm<float>(true, false, n, kk, m, 1.f, dy.host.data() + r0 * n, n,
                         x.host.data() + r0 * kk, kk, 0.f, dwr.data() + e * n * kk, kk);
    }
    expect_close(tag + " x W^T (twice, accumulated)", download_f(y), yr, kBf16Tol);
    expect_close(tag + " dy W", download_f(dx), dxr, kBf16Tol);
    expect_close(tag + " weight grad (fp32 =, over NaN)", dw_written, dwr, 1e-5);
    std::vector<float> dwr2 = dwr;
    for (float& v : dwr2) v *= 2.f;
    expect_close(tag + " weight grad (fp32 +=)", dw.download(), dwr2, 1e-5);
    expect_guard(y, tag + " y");
    expect_guard(dx, tag + " dx");
    expect_guard(dw, tag + " dw");
}
}  // namespace

// Dimensions that are multiples of 8: the pipelined tensor-core kernel, with partial tiles in
// every dimension (96 < 128 columns, 80 = 2.5 reduction slices, odd row counts).
TEST_F(CudaOps, GroupedGemmAllKinds) {
    grouped_gemm_check(*session_, {0, 37, 37, 101, 130, 200}, 96, 80, 70, "grouped gemm");
}

// Several 128 x 128 tiles per expert and more reduction slices than pipeline stages.
TEST_F(CudaOps, GroupedGemmManyTiles) {
    grouped_gemm_check(*session_, {0, 300, 301, 301, 560}, 264, 392, 300, "grouped gemm (tiles)");
}

namespace {
// Every tensor-core form of the grouped GEMM (the dispatch's choice; on sm_90a the wgmma kernel on
// four blocks, so every block walks many tiles; the WMMA kernel of other GPUs) against per-expert
// CPU GEMMs, each kind, partial tiles; the weight gradient written over NaN (an empty expert:
// zeros), then added to (twice the product).
void grouped_gemm_every_form(const cuda::CudaSession& session, const std::vector<int32_t>& off,
                             int64_t n, int64_t kk) {
    const ExecContext& ctx = session.ctx();
    const int64_t E = int64_t(off.size()) - 1, R = off.back(), cap = R + kNanPad;
    int64_t max_rows = 0;
    for (int64_t e = 0; e < E; ++e) max_rows = std::max<int64_t>(max_rows, off[e + 1] - off[e]);
    DeviceArray<int32_t> doff(off);
    Rounded w(E * n * kk, 121, 0.3);
    Rounded x = nan_padded_rows(R, kNanPad, kk, 122), dy = nan_padded_rows(R, kNanPad, n, 123);
    std::vector<float> yr(R * n), dxr(R * kk), dwr(E * n * kk, 0.f);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = off[e], m = off[e + 1] - off[e];
        if (m == 0) continue;
        const float* we = w.host.data() + e * n * kk;
        cpu::gemm<float>(false, true, m, n, kk, 1.f, x.host.data() + r0 * kk, kk, we, kk, 0.f,
                         yr.data() + r0 * n, n);
        cpu::gemm<float>(false, false, m, kk, n, 1.f, dy.host.data() + r0 * n, n, we, kk, 0.f,
                         dxr.data() + r0 * kk, kk);
        cpu::gemm<float>(true, false, n, kk, m, 1.f, dy.host.data() + r0 * n, n,
                         x.host.data() + r0 * kk, kk, 0.f, dwr.data() + e * n * kk, kk);
    }
    std::vector<float> dwr2 = dwr;
    for (float& v : dwr2) v *= 2.f;
    using K2 = cuda::GroupedGemm;
    using GemmForm = std::function<void(K2, const bf16*, const bf16*, void*, bool)>;
    std::vector<std::pair<std::string, GemmForm>> forms;
    forms.emplace_back(
        "grouped_gemm", [&](K2 kind, const bf16* a, const bf16* b, void* c, bool acc) {
            cuda::grouped_gemm(ctx, {kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc});
        });
    if (cuda::has_sm90a())
        forms.emplace_back("wgmma on 4 blocks",
                           [&](K2 kind, const bf16* a, const bf16* b, void* c, bool acc) {
                               cuda::grouped_gemm_wgmma(
                                   ctx, {kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc}, 4);
                           });
    forms.emplace_back("WMMA", [&](K2 kind, const bf16* a, const bf16* b, void* c, bool acc) {
        cuda::grouped_gemm_wmma(ctx, {kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc});
    });
    for (const auto& [name, run] : forms) {
        DeviceArray<bf16> y(R * n), dx(R * kk);
        DeviceArray<float> dw(
            std::vector<float>(E * n * kk, std::numeric_limits<float>::quiet_NaN()));
        run(K2::RowsTimesWeightT, x.dev, w.dev, static_cast<bf16*>(y), false);
        run(K2::RowsTimesWeight, dy.dev, w.dev, static_cast<bf16*>(dx), false);
        run(K2::WeightGrad, dy.dev, x.dev, static_cast<float*>(dw), false);
        session.synchronize();
        expect_close(name + ": x W^T", download_f(y), yr, kBf16Tol);
        expect_close(name + ": dy W", download_f(dx), dxr, kBf16Tol);
        expect_close(name + ": weight grad (=, over NaN)", dw.download(), dwr, 1e-5);
        run(K2::WeightGrad, dy.dev, x.dev, static_cast<float*>(dw), true);
        session.synchronize();
        expect_close(name + ": weight grad (+=)", dw.download(), dwr2, 1e-5);
    }
}
}  // namespace

TEST_F(CudaOps, GroupedGemmEveryForm) {
    grouped_gemm_every_form(*session_, {0, 37, 37, 101, 260}, 136, 200);
}
// Reductions of many more 64-deep slices than pipeline stages (x W^T 17, weight gradient up to
// 10; every dimension a multiple of 8, as the 16-byte copies need) and several tiles per block: the
// persistent kernels' stage rings wrap many times within a tile (a ping-pong kernel's first form,
// since removed, passed the 4-slice case above and hung at this depth).
TEST_F(CudaOps, GroupedGemmEveryFormDeepReduction) {
    grouped_gemm_every_form(*session_, {0, 300, 301, 301, 900}, 264, 1088);
}

// Dimensions not a multiple of 8: the simple fallback kernel.
TEST_F(CudaOps, GroupedGemmUnalignedFallback) {
    grouped_gemm_check(*session_, {0, 37, 37, 101, 130, 200}, 36, 20, 70,
                       "grouped gemm (unaligned)");
}

namespace {
// The paged stash's kernels against the CPU reference: the same pushes and pops (one overflowing)
// give the same state words, page tables, pool pages and popped rows. `widths` picks the copy
// path (multiples of 8: 16-byte vectors; otherwise element by element).
void paged_stash_check(const cuda::CudaSession& session, std::vector<int64_t> widths) {
    const ExecContext& ctx = session.ctx();
    const int64_t pages = 12, page_rows = 8, max_rows = 40, tbl = 1 + 5;
    int64_t width = 0;
    for (int64_t w : widths) width += w;
    struct Push {
        int32_t rows;
        std::vector<std::vector<float>> host;  // per segment, bf16-exact
        std::vector<std::unique_ptr<DeviceArray<bf16>>> dev;
    };
    const int32_t rows[] = {17, 33, 40, 0};  // 3, 5 and 5 pages: the third overflows; then none
    std::vector<Push> push(4);
    for (int i = 0; i < 4; ++i) {
        push[i].rows = rows[i];
        for (size_t s = 0; s < widths.size(); ++s) {
            push[i].host.push_back(random_vector<float>(max_rows * widths[s], 900 + 10 * i + s));
            push[i].dev.push_back(
                std::make_unique<DeviceArray<bf16>>(to_bf16_rounding(push[i].host.back())));
        }
    }
    auto rows_of = [&](std::vector<std::unique_ptr<DeviceArray<bf16>>>& d) {
        StashRows r;
        r.count = int(widths.size());
        for (size_t s = 0; s < widths.size(); ++s) r.data[s] = d[s]->get(), r.width[s] = widths[s];
        return r;
    };
    // Device side.
    DeviceArray<int32_t> state(kStashStateWords), free_list(pages),
        counts(std::vector<int32_t>(rows, rows + 4));
    DeviceArray<bf16> pool(pages * page_rows * width);
    std::vector<std::unique_ptr<DeviceArray<int32_t>>> tables;
    for (int i = 0; i < 4; ++i) tables.push_back(std::make_unique<DeviceArray<int32_t>>(tbl));
    // Host side.
    std::vector<int32_t> hstate(kStashStateWords), hfree(pages), htables(4 * tbl, -7);
    std::vector<bf16> hpool(pages * page_rows * width);
    cuda::stash_reset(ctx, state, free_list, pages, true);
    cpu::stash_reset(hstate.data(), hfree.data(), pages, true);
    for (int i = 0; i < 4; ++i) {
        cuda::stash_push(ctx, state, free_list, pages, *tables[i], max_rows, counts.get() + i,
                         page_rows, rows_of(push[i].dev), pool);
        std::vector<std::vector<bf16>> segs;
        StashRows h;
        h.count = int(widths.size());
        for (size_t s = 0; s < widths.size(); ++s) segs.push_back(push[i].dev[s]->download());
        for (size_t s = 0; s < widths.size(); ++s)
            h.data[s] = segs[s].data(), h.width[s] = widths[s];
        cpu::stash_push(hstate.data(), hfree.data(), pages, htables.data() + i * tbl, max_rows,
                        &rows[i], page_rows, h, hpool.data());
    }
    session.synchronize();
    EXPECT_EQ(state.download(), hstate);
    EXPECT_EQ(hstate[2], 1) << "the third push should overflow";
    for (int i = 0; i < 4; ++i) {
        auto t = tables[i]->download();
        const int32_t n = htables[i * tbl];
        ASSERT_EQ(t[0], n) << "push " << i;
        for (int32_t j = 0; j < std::max(n, 0); ++j) EXPECT_EQ(t[1 + j], htables[i * tbl + 1 + j]);
    }
    // Every page the pushes hold has the reference's contents.
    auto dpool = pool.download();
    for (int i = 0; i < 4; ++i)
        for (int32_t j = 0; j < std::max(htables[i * tbl], 0); ++j) {
            const int64_t at = int64_t(htables[i * tbl + 1 + j]) * page_rows * width;
            const int64_t used = std::min<int64_t>(page_rows, rows[i] - j * page_rows) * width;
            for (int64_t e = 0; e < used; ++e)
                ASSERT_EQ(dpool[at + e].bits, hpool[at + e].bits) << "push " << i << " page " << j;
        }
    // Pop in reverse into fresh (poisoned) buffers: the rows come back bit for bit.
    for (int i = 3; i >= 0; --i) {
        std::vector<std::unique_ptr<DeviceArray<bf16>>> back;
        for (int64_t w : widths) back.push_back(std::make_unique<DeviceArray<bf16>>(max_rows * w));
        cuda::stash_pop(ctx, state, free_list, *tables[i], max_rows, counts.get() + i, page_rows,
                        rows_of(back), pool);
        std::vector<std::vector<bf16>> hb;
        StashRows h;
        h.count = int(widths.size());
        for (size_t s = 0; s < widths.size(); ++s) hb.emplace_back(max_rows * widths[s]);
        for (size_t s = 0; s < widths.size(); ++s) h.data[s] = hb[s].data(), h.width[s] = widths[s];
        cpu::stash_pop(hstate.data(), hfree.data(), htables.data() + i * tbl, &rows[i], page_rows,
                       h, hpool.data());
        session.synchronize();
        if (htables[i * tbl] < 0) continue;  // the overflowed push has nothing to give back
        for (size_t s = 0; s < widths.size(); ++s) {
            auto got = to_float(back[s]->download());
            got.resize(size_t(rows[i] * widths[s]));
            std::vector<float> want(push[i].host[s].begin(),
                                    push[i].host[s].begin() + rows[i] * widths[s]);
            EXPECT_EQ(got, want) << "push " << i << " segment " << s;
            EXPECT_TRUE(back[s]->guard_intact());
        }
    }
    EXPECT_EQ(state.download(), hstate);
    EXPECT_EQ(free_list.download(), hfree);
    EXPECT_EQ(hstate[0], pages);
    EXPECT_TRUE(pool.guard_intact());
    std::cout << "[harness] paged stash widths " << widths.size() << " segments, " << width
              << " per row: peak pages " << hstate[1] << ", demand " << hstate[3] << " of " << pages
              << "\n";
}
}  // namespace

TEST_F(CudaOps, PagedStashMatchesTheCpuReference) {
    paged_stash_check(*session_, {16, 8, 24});  // vectorized copies
    paged_stash_check(*session_, {3, 2, 5});    // element by element
}

TEST_F(CudaOps, GradNormClipAndAdamW) {
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
TEST_F(CudaOps, GradNormOverManyPartials) {
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

namespace {
// Teacher/student KL of the DSA indexer in fp64 (SPEC §3.1), one row: returns kl, fills dscore.
double reference_indexer_kl(const std::vector<float>& qabs, const std::vector<float>& kabs,
                            const std::vector<float>* lse, int64_t T, int64_t H, int64_t L,
                            double scale, const std::vector<float>& scores,
                            const std::vector<int32_t>& support, int64_t t,
                            std::vector<float>& dscore) {
    const int64_t n = int64_t(support.size());
    std::vector<double> p(n, 0.0), z(n);
    for (int64_t h = 0; h < H; ++h) {
        double mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
            double d = 0;
            for (int64_t i = 0; i < L; ++i)
                d += double(qabs[(t * H + h) * L + i]) * kabs[support[j] * L + i];
            z[j] = d * scale;
            mx = std::max(mx, z[j]);
        }
        double l;
        if (lse) {
            l = (*lse)[h * T + t];
        } else {
            double s = 0;
            for (double v : z) s += std::exp(v - mx);
            l = mx + std::log(s);
        }
        for (int64_t j = 0; j < n; ++j) p[j] += std::exp(z[j] - l);
    }
    double ps = 0;
    for (double v : p) ps += v;
    double mx = -INFINITY;
    for (int32_t s : support) mx = std::max(mx, double(scores[t * T + s]));
    double sum = 0;
    for (int32_t s : support) sum += std::exp(double(scores[t * T + s]) - mx);
    const double lse_i = mx + std::log(sum);
    double kl = 0;
    for (int64_t j = 0; j < n; ++j) {
        const double pj = p[j] / ps, logq = double(scores[t * T + support[j]]) - lse_i;
        kl += pj * (std::log(pj) - logq);
        dscore[t * T + support[j]] = float(std::exp(logq) - pj);
    }
    return kl;
}
}  // namespace

TEST_F(CudaOps, IndexerKlLossAndScoresBackward) {
    const Docs docs;
    const int64_t T = 200, H = 4, L = 40, HI = 3, dI = 24, K = 16;
    const float scale = 0.2f;
    auto rbv = docs.row_begin(T);
    Rounded qabs(T * H * L, 131), kabs(T * L, 132), q(T * HI * dI, 133), k(T * dI, 134);
    auto scores = random_vector<float>(T * T, 135, 3.0);  // a student far from the teacher
    auto lse = random_vector<float>(H * T, 136, 0.5);
    auto w = random_vector<float>(T * HI, 137);
    // Sparse supports: the first min(K, n) causal keys in a scrambled but ascending order.
    std::vector<int32_t> idx(T * K, -1), len(T, 0);
    for (int64_t t = 0; t < T; ++t) {
        if (rbv[t] < 0) continue;
        const int64_t n = std::min<int64_t>(K, t - rbv[t] + 1);
        for (int64_t j = 0; j < n; ++j)
            idx[t * K + j] = int32_t(rbv[t] + (j * 7) % (t - rbv[t] + 1));
        std::sort(idx.begin() + t * K, idx.begin() + t * K + n);
        len[t] = int32_t(std::unique(idx.begin() + t * K, idx.begin() + t * K + n) -
                         (idx.begin() + t * K));
        std::fill(idx.begin() + t * K + len[t], idx.begin() + (t + 1) * K, -1);
    }
    // The sparse loss uses the attention's lse: make it the exact lse over the support so p sums
    // to one per head, as the attention produces it.
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
            double mx = -INFINITY;
            std::vector<double> z;
            for (int64_t j = 0; j < len[t]; ++j) {
                double d = 0;
                for (int64_t i = 0; i < L; ++i)
                    d += double(qabs.host[(t * H + h) * L + i]) * kabs.host[idx[t * K + j] * L + i];
                z.push_back(d * scale);
                mx = std::max(mx, z.back());
            }
            double s = 0;
            for (double v : z) s += std::exp(v - mx);
            lse[h * T + t] = z.empty() ? 0.f : float(mx + std::log(s));
        }
    DeviceArray<int32_t> rb(rbv), didx(idx), dlen(len);
    DeviceArray<float> dsc(scores), dlse(lse), dw_in(w), kl(T), dscore(T * T), sums(2);
    DeviceArray<double> klsum(2);
    for (bool sparse : {true, false}) {
        cuda::zero(ctx(), dscore, T * T * sizeof(float));
        cuda::zero(ctx(), klsum, 2 * sizeof(double));
        cuda::indexer_kl(ctx(),
                         {.sparse = sparse,
                          .qabs = qabs.dev,
                          .kabs = kabs.dev,
                          .lse = dlse,
                          .heads = H,
                          .dl = L,
                          .scale = scale,
                          .scores = dsc,
                          .idx = didx,
                          .len = dlen,
                          .kslots = K,
                          .row_begin = rb,
                          .tokens = T},
                         kl, dscore);
        cuda::indexer_kl_sum(ctx(), kl, dlen, T, klsum);
        sync();
        std::vector<float> klr(T, 0.f), dref(T * T, 0.f);
        std::vector<bool> on_support(T * T, false);
        double total = 0;
        for (int64_t t = 0; t < T; ++t) {
            if (rbv[t] < 0) continue;
            std::vector<int32_t> sup;
            if (sparse)
                sup.assign(idx.begin() + t * K, idx.begin() + t * K + len[t]);
            else
                for (int32_t s = rbv[t]; s <= t; ++s) sup.push_back(s);
            for (int32_t s : sup) on_support[t * T + s] = true;
            klr[t] = float(reference_indexer_kl(qabs.host, kabs.host, sparse ? &lse : nullptr, T, H,
                                                L, scale, scores, sup, t, dref));
            total += klr[t];
        }
        std::vector<bool> real(T);
        for (int64_t t = 0; t < T; ++t) real[t] = rbv[t] >= 0;
        const std::string tag = sparse ? "sparse" : "dense";
        expect_close("indexer kl " + tag, kl.download(), klr, 1e-4, real);
        expect_close("indexer dscore " + tag, dscore.download(), dref, 1e-4, on_support);
        auto ks = klsum.download();
        EXPECT_NEAR(ks[0], total, 1e-4 * total);
        EXPECT_EQ(int64_t(ks[1]), 180);
        // Back through the scores: dw, dq, dk against fp64 loops on the CPU's dscore, by the
        // per-row kernel (no workspace) and by the GEMM form in three chunks of query tokens.
        // dscore off the support is poisoned: neither form may read it there.
        std::vector<float> dpois = dref;
        for (int64_t i = 0; i < T * T; ++i)
            if (!on_support[i]) dpois[i] = std::numeric_limits<float>::quiet_NaN();
        DeviceArray<float> dds(dpois);
        const float g = 0.37f;
        const int64_t per_token = cuda::indexer_scores_backward_bytes_per_token(T, HI);
        DeviceArray<uint8_t> ws(per_token * ((T + 2) / 3));
        for (const bool gemm_form : {false, true}) {
            SCOPED_TRACE(gemm_form ? "GEMM form" : "per-row kernel");
            DeviceArray<float> dwo(T * HI), dk(T * dI);
            DeviceArray<bf16> dq(T * HI * dI);
            cuda::indexer_scores_backward(ctx(),
                                          {.sparse = sparse,
                                           .q = q.dev,
                                           .k = k.dev,
                                           .w = dw_in,
                                           .dscore = dds,
                                           .grad_scale = g,
                                           .idx = didx,
                                           .len = dlen,
                                           .kslots = K,
                                           .row_begin = rb,
                                           .tokens = T,
                                           .heads = HI,
                                           .dim = dI,
                                           .workspace = gemm_form ? ws.get() : nullptr,
                                           .workspace_bytes = per_token * ((T + 2) / 3)},
                                          dwo, dq, dk);
            sync();
            std::vector<double> dwr(T * HI, 0), dqr(T * HI * dI, 0), dkr(T * dI, 0);
            for (int64_t t = 0; t < T; ++t)
                for (int64_t s = 0; s < T; ++s) {
                    if (!on_support[t * T + s]) continue;
                    const double gs = g * double(dref[t * T + s]);
                    for (int64_t j = 0; j < HI; ++j) {
                        double d = 0;
                        for (int64_t i = 0; i < dI; ++i)
                            d += double(q.host[(t * HI + j) * dI + i]) * k.host[s * dI + i];
                        if (d <= 0) continue;
                        dwr[t * HI + j] += gs * d;
                        for (int64_t i = 0; i < dI; ++i) {
                            dqr[(t * HI + j) * dI + i] += gs * w[t * HI + j] * k.host[s * dI + i];
                            dkr[s * dI + i] += gs * w[t * HI + j] * q.host[(t * HI + j) * dI + i];
                        }
                    }
                }
            auto f = [](const std::vector<double>& v) {
                return std::vector<float>(v.begin(), v.end());
            };
            expect_close("indexer dw " + tag, dwo.download(), f(dwr), 1e-5);
            expect_close("indexer dq " + tag, download_f(dq), f(dqr), kBf16Tol);
            // The GEMM form rounds the per-head logit gradients to bf16 before the dk GEMM (the
            // seed's bf16 autograd does the same); the per-row kernel adds them in fp32.
            expect_close("indexer dk " + tag, dk.download(), f(dkr), gemm_form ? 1e-2 : 1e-5);
        }
    }
}

// Both softmax kernels: 704 columns take the 16-byte online one, 701 the three-pass one.
TEST_F(CudaOps, SoftmaxRowsBothKernels) {
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
TEST_F(CudaOps, MtpTvSoftmaxOverlapChainAndGradient) {
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

// Rows of 40 take the 16-byte vector kernels, rows of 36 the scalar ones.
TEST_F(CudaOps, MoeBackwardPieces) {
    for (const int64_t dim : {int64_t(40), int64_t(36)}) {
        SCOPED_TRACE(cat("dim ", dim));
        const int64_t T = 150, k = 3, E = 6, R = T * k;
        // Routing: every third token unrouted in its last choice (a capacity drop), rows permuted.
        std::vector<int32_t> slot(T * k), topk(T * k);
        for (int64_t i = 0; i < T * k; ++i) {
            slot[i] = (i % k == k - 1 && (i / k) % 3 == 0) ? -1 : int32_t((i * 7) % R);
            topk[i] = int32_t((i * 5 + i / k) % E);
        }
        // Distinct experts per token (the router never picks one twice).
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j) topk[t * k + j] = int32_t((t + j * 2) % E);
        auto gates = random_vector<float>(T * k, 151);
        auto probs = random_vector<float>(T * E, 152);
        for (auto& x : probs) x = 0.5f + 0.45f * x;
        Rounded dy(T * dim, 153), outp(R * dim, 154), dxp(R * dim, 155), dm0(T * dim, 156);
        DeviceArray<int32_t> dslot(slot), dtopk(topk);
        DeviceArray<float> dgates_in(gates), dprobs(probs), dgates(T * k), dlogits(T * E);
        DeviceArray<bf16> doutp(R * dim);
        cuda::moe_combine_backward(ctx(), dy.dev, outp.dev, dslot, dgates_in, T, k, dim, doutp,
                                   dgates);
        cuda::moe_gather_backward(ctx(), dxp.dev, dslot, T, k, dim, dm0.dev, true);
        sync();
        std::vector<float> dop_ref = download_f(doutp), dg_ref(T * k, 0.f), dm_ref = dm0.host;
        std::vector<bool> written(R * dim, false);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j) {
                const int32_t r = slot[t * k + j];
                if (r < 0) continue;
                double s = 0;
                for (int64_t c = 0; c < dim; ++c) {
                    s += double(dy.host[t * dim + c]) * outp.host[r * dim + c];
                    dop_ref[r * dim + c] = gates[t * k + j] * dy.host[t * dim + c];
                    written[r * dim + c] = true;
                    dm_ref[t * dim + c] += dxp.host[r * dim + c];
                }
                dg_ref[t * k + j] = float(s);
            }
        expect_close("moe combine backward dout_perm", download_f(doutp), dop_ref, kBf16Tol,
                     written);
        expect_close("moe combine backward dgates", dgates.download(), dg_ref, 1e-5);
        expect_close("moe gather backward (accumulate)", download_f(dm0.dev), dm_ref, kBf16Tol);
        // Router: gates = 2.5 s_c / Σ s_chosen through the sigmoid, by central differences.
        cuda::router_backward(ctx(), dprobs, dtopk, dgates, T, E, k, 2.5f, dlogits);
        sync();
        auto dgg = dgates.download();
        std::vector<float> dlr(T * E, 0.f);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < E; ++e) {
                auto f = [&](double delta) {
                    // probs are sigmoid(logit): perturb the logit.
                    std::vector<double> s(E);
                    for (int64_t x = 0; x < E; ++x) {
                        const double p = probs[t * E + x];
                        const double logit = std::log(p / (1 - p)) + (x == e ? delta : 0);
                        s[x] = 1 / (1 + std::exp(-logit));
                    }
                    double S = 1e-20, out = 0;
                    for (int64_t j = 0; j < k; ++j) S += s[topk[t * k + j]];
                    for (int64_t j = 0; j < k; ++j)
                        out += dgg[t * k + j] * 2.5 * s[topk[t * k + j]] / S;
                    return out;
                };
                dlr[t * E + e] = float((f(1e-5) - f(-1e-5)) / 2e-5);
            }
        expect_close("router backward (vs central differences)", dlogits.download(), dlr, 1e-4);
    }
}

// Both kernels: head dims that are multiples of 4 (the vector kernel) and ones that are not.
TEST_F(CudaOps, MlaExpandedKvGradient) {
    for (const auto [dn, dr, dv] : {std::array<int64_t, 3>{16, 8, 12}, {14, 6, 10}}) {
        SCOPED_TRACE(cat("dn ", dn, " dr ", dr, " dv ", dv));
        const int64_t T = 70, H = 3;
        auto dk = random_vector<float>(T * H * (dn + dr), 161),
             dv32 = random_vector<float>(T * H * dv, 162);
        const int64_t L = 40;  // the kv_a row: [kr | dr] with the pe part at column 32
        DeviceArray<float> ddk(dk), ddv(dv32);
        DeviceArray<bf16> dkv(T * H * (dn + dv)), dckv(T * L);
        cuda::mla_expanded_kv_grad(ctx(), ddk, ddv, T, H, dn, dr, dv, dkv, dckv.get() + 32, L);
        sync();
        std::vector<float> kvr(T * H * (dn + dv)), per(T * L, 0.f);
        std::vector<bool> pe_cols(T * L);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H; ++h) {
                for (int64_t i = 0; i < dn; ++i)
                    kvr[(t * H + h) * (dn + dv) + i] = dk[(t * H + h) * (dn + dr) + i];
                for (int64_t i = 0; i < dv; ++i)
                    kvr[(t * H + h) * (dn + dv) + dn + i] = dv32[(t * H + h) * dv + i];
                for (int64_t i = 0; i < dr; ++i)
                    per[t * L + 32 + i] += dk[(t * H + h) * (dn + dr) + dn + i];
            }
        for (int64_t i = 0; i < T * L; ++i) pe_cols[i] = i % L >= 32 && i % L < 32 + dr;
        expect_close("mla expanded dkv", download_f(dkv), kvr, kBf16Tol);
        expect_close("mla expanded d k_pe (sum over heads)", download_f(dckv), per, kBf16Tol,
                     pe_cols);
    }
}

// Context parallelism: a rank's query rows are some of the micro-batch's key rows (here every
// other row, key_row[i] = 2i + 1), so the masked-dense form scores every chunk against all key
// rows and the top-k picks which count. It must agree with the gathered form on the same inputs
// (out, lse, head probability sums, dq, and dkv over every key row), in one chunk and in three.
TEST_F(CudaOps, SparseMqaMaskedDenseWithMoreKeysThanQueries) {
    const ExecContext& ctx = session_->ctx();
    const int64_t H = 12, dqk = 72, dv = 64, K = 32, Tq = 100, Tk = 200;
    Rounded q(Tq * H * dqk, 91), kv(Tk * dqk, 92), dout(Tq * H * dv, 93);
    std::vector<int32_t> idx(Tq * K, -1), len(Tq, 0);
    CounterRng rng(94, 1);
    uint64_t draw = 0;
    for (int64_t i = 0; i < Tq; ++i) {
        const int64_t row = 2 * i + 1, begin = row >= 120 ? 120 : 0;  // two documents
        std::vector<int32_t> cand(size_t(row - begin + 1));
        std::iota(cand.begin(), cand.end(), int32_t(begin));
        for (size_t j = cand.size(); j > 1; --j) std::swap(cand[j - 1], cand[rng.bits(draw++) % j]);
        const int64_t n = std::min<int64_t>(K, int64_t(cand.size()));
        std::sort(cand.begin(), cand.begin() + n);
        std::copy_n(cand.begin(), n, idx.begin() + i * K);
        len[size_t(i)] = int32_t(n);
    }
    DeviceArray<int32_t> didx(idx), dlen(len);
    const float scale = float(0.9 / std::sqrt(double(dqk)));
    struct Result {
        std::vector<float> out, lse, psum, dq, dkv;
    };
    auto run = [&](int chunks) {
        DeviceArray<bf16> out(Tq * H * dv), dq(Tq * H * dqk);
        DeviceArray<float> lse(H * Tq), dkv(Tk * dqk), psum(Tq * K);
        const int64_t planned = cuda::sparse_mqa_workspace_bytes(Tq, H, K, Tk);
        EXPECT_EQ(planned, Tq * H * ((Tk + 15) / 16 * 16) * 10) << "one chunk, rows of all keys";
        const int64_t bytes = chunks ? (Tq + chunks - 1) / chunks * (planned / Tq) : 0;
        DeviceArray<float> ws(std::max<int64_t>(1, (bytes + 3) / 4));
        void* w = chunks ? static_cast<void*>(static_cast<float*>(ws)) : nullptr;
        const cuda::SparseMqa problem{Tq, H, dqk, dv, q.dev, kv.dev, didx, dlen, K, scale, Tk};
        cuda::sparse_mqa_forward(ctx, problem, out, lse, psum, {w, bytes});
        cuda::sparse_mqa_backward(ctx, problem, out, lse, dout.dev, dq, dkv, {w, bytes});
        session_->synchronize();
        EXPECT_TRUE(dkv.guard_intact());
        return Result{download_f(out), lse.download(), psum.download(), download_f(dq),
                      dkv.download()};
    };
    const Result gathered = run(0);
    for (int chunks : {1, 3}) {
        const Result masked = run(chunks);
        const std::string tag =
            cat("sparse mqa masked, ", Tq, " queries over ", Tk, " keys, ", chunks, " chunk(s)");
        expect_close(tag + " out", masked.out, gathered.out, kBf16Tol);
        expect_close(tag + " lse", masked.lse, gathered.lse, 1e-5);
        expect_close(tag + " head probability sums", masked.psum, gathered.psum, 1e-4);
        expect_close(tag + " dq", masked.dq, gathered.dq, kBf16Tol);
        expect_close(tag + " dkv", masked.dkv, gathered.dkv, kBf16Tol);
    }
}

#endif  // SPARSETRON_WITH_CUDA
