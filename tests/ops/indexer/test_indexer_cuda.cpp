// The indexer family on CUDA against the CPU reference: scores and the top-k rule (ties
// included), the KL loss and the backward through the scores in both forms.
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
#include "sparsetron/cuda/device_caps.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/indexer/indexer.h"

#if SPARSETRON_WITH_CUDA
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(IndexerCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The indexer family's CUDA tests: the shared op fixture (op_fixtures.h).
class IndexerCuda : public CudaOps {};

TEST_F(IndexerCuda, IndexerScoresAndTopk) {
    const Docs docs;
    const int64_t T = 200, H = 4, d = 32, K = 16;
    Rounded q(T * H * d, 91), k(T * d, 92);
    auto w = random_vector<float>(T * H, 93);
    DeviceArray<float> dw(w), scores(T * T);
    auto rbv = docs.row_begin(T);
    DeviceArray<int32_t> rb(rbv), idx(T * K), len(T);
    // The simple kernel (the Rows form), then the Gemm form with the planned workspace (one chunk
    // at this size) and with one of 64 query rows (4 chunks, the last partial); the last one's
    // scores are checked, and each form's against the first. Every form this problem supports
    // runs (indexer_plan.h).
    const cuda::IndexerProblem problem{
        .tokens = T, .heads = H, .dim = d, .sm90a = cuda::has_sm90a()};
    EXPECT_EQ(cuda::supported_score_forms(problem),
              (std::vector<cuda::IndexerScoresForm>{cuda::IndexerScoresForm::Gemm,
                                                    cuda::IndexerScoresForm::Rows}));
    EXPECT_EQ(cuda::plan_indexer(problem).scores, cuda::IndexerScoresForm::Gemm);
    const int64_t planned = cuda::indexer_scores_workspace_bytes(T, H);
    ASSERT_EQ(planned, T * H * T * 4);
    DeviceArray<float> ws(planned / 4);
    cuda::indexer_scores(ctx(), cuda::IndexerScoresForm::Rows, q.dev, k.dev, dw, rb, T, H, d,
                         scores);
    sync();
    const auto simple = scores.download();
    for (int64_t bytes : {planned, int64_t(64 * H * T * 4)}) {
        cuda::fill(ctx(), scores, T * T, -7.f);
        cuda::indexer_scores(ctx(), cuda::IndexerScoresForm::Gemm, q.dev, k.dev, dw, rb, T, H, d,
                             scores, ws, bytes);
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

// The model's form for long micro-batches without the indexer loss: scores and top-k per block
// of query rows against the keys before the block's end (the key-row form, rows = the row's own
// index), equal to the whole micro-batch's: the same top-k and lengths, scores within rounding.
// At the GLM-5 indexer shape (32 heads x 128: the fused wgmma kernel on sm_90a) and a small one.
TEST_F(IndexerCuda, IndexerScoresAndTopkInQueryBlocks) {
    for (const auto& [H, d] : {std::pair<int64_t, int64_t>{32, 128}, {4, 32}}) {
        SCOPED_TRACE(cat(H, " heads x ", d));
        const int64_t T = 700, K = 64, block = 256;
        Rounded q(T * H * d, 191), k(T * d, 192);
        DeviceArray<float> dw(random_vector<float>(T * H, 193)), scores(T * T), part(block * T);
        // Documents [0, 500) and [500, 690), then padding rows.
        std::vector<int32_t> rbv(T, -1), rowsv(T, -1);
        for (int64_t t = 0; t < 690; ++t) rbv[t] = t < 500 ? 0 : 500, rowsv[t] = int32_t(t);
        DeviceArray<int32_t> rb(rbv), rows(rowsv), idx(T * K), len(T), bidx(T * K), blen(T);
        // The fused kernel where it runs, else the simple one: the forms of the key-row blocks.
        const cuda::IndexerScoresForm form = cuda::has_sm90a() && cuda::indexer_wgmma_shape(H, d)
                                                 ? cuda::IndexerScoresForm::Wgmma
                                                 : cuda::IndexerScoresForm::Rows;
        cuda::indexer_scores(ctx(), form, q.dev, k.dev, dw, rb, T, H, d, scores);
        cuda::topk_rows(ctx(), scores, T, rb, T, K, idx, len);
        sync();
        const auto whole = scores.download();
        for (int64_t t0 = 0; t0 < T; t0 += block) {
            const int64_t n = std::min(block, T - t0), keys = t0 + n;
            cuda::fill(ctx(), part, block * T, -7.f);
            cuda::indexer_scores(ctx(), form, q.dev + t0 * H * d, k.dev, dw + t0 * H, rb + t0, n, H,
                                 d, part, nullptr, 0, rows + t0, keys);
            cuda::topk_rows(ctx(), part, keys, rb + t0, n, K, bidx + t0 * K, blen + t0, rows + t0);
            sync();
            const auto got = part.download();
            double worst = 0;
            for (int64_t t = t0; t < t0 + n; ++t)
                for (int64_t s = rbv[t]; rbv[t] >= 0 && s <= t; ++s)
                    worst = std::max(
                        worst, std::fabs(double(got[(t - t0) * keys + s]) - whole[t * T + s]) /
                                   std::max(1.0, std::fabs(double(whole[t * T + s]))));
            EXPECT_LE(worst, 1e-6) << "block at " << t0;
        }
        EXPECT_EQ(bidx.download(), idx.download());
        EXPECT_EQ(blen.download(), len.download());
        expect_guard(bidx, "block topk idx");
    }
}

TEST_F(IndexerCuda, TopkTiesGoToTheSmallerIndex) {
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

TEST_F(IndexerCuda, IndexerKlLossAndScoresBackward) {
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
        // per-row kernel (no workspace) and by the GEMM form in three chunks of query tokens per
        // call, over all rows at once and in blocks of rows (one call per block).
        // dscore off the support is poisoned: neither form may read it there.
        std::vector<float> dpois = dref;
        for (int64_t i = 0; i < T * T; ++i)
            if (!on_support[i]) dpois[i] = std::numeric_limits<float>::quiet_NaN();
        const float g = 0.37f;
        // Rows [t0, t0 + n) of a [T, T] matrix, each cut to its first `keys` columns: a block's
        // [n, first_row + n] layout.
        auto block_rows = [&](const std::vector<float>& m, int64_t t0, int64_t n, int64_t keys) {
            std::vector<float> part(n * keys);
            for (int64_t t = 0; t < n; ++t)
                std::copy_n(m.begin() + (t0 + t) * T, keys, part.begin() + t * keys);
            return part;
        };
        // Blocks of query rows (the model streams the loss that way at length): each block's
        // KL and dscore from the block's own [rows, first_row + rows] scores, then its backward
        // adding into one dk.
        const int64_t block = 70;
        {
            DeviceArray<float> bkl(T);
            std::vector<float> bdscore(T * T, 0.f);
            for (int64_t t0 = 0; t0 < T; t0 += block) {
                const int64_t n = std::min(block, T - t0), keys = t0 + n;
                DeviceArray<float> dpart(block_rows(scores, t0, n, keys)), dout(n * keys);
                cuda::indexer_kl(ctx(),
                                 {.sparse = sparse,
                                  .qabs = qabs.dev + t0 * H * L,
                                  .kabs = kabs.dev,
                                  .lse = dlse + t0,
                                  .heads = H,
                                  .dl = L,
                                  .scale = scale,
                                  .scores = dpart,
                                  .idx = didx + t0 * K,
                                  .len = dlen + t0,
                                  .kslots = K,
                                  .row_begin = rb + t0,
                                  .tokens = n,
                                  .first_row = t0,
                                  .lse_ld = T},
                                 bkl + t0, dout);
                sync();
                const auto got = dout.download();
                for (int64_t t = 0; t < n; ++t)
                    std::copy_n(got.begin() + t * keys, keys, bdscore.begin() + (t0 + t) * T);
            }
            expect_close("indexer kl in blocks " + tag, bkl.download(), klr, 1e-4, real);
            expect_close("indexer dscore in blocks " + tag, bdscore, dref, 1e-4, on_support);
        }
        const int64_t per_token = cuda::indexer_scores_backward_bytes_per_token(T, HI);
        DeviceArray<uint8_t> ws(per_token * ((T + 2) / 3));
        for (const auto& [gemm_form, blocks] : {std::pair{false, false}, std::pair{true, false},
                                                std::pair{false, true}, std::pair{true, true}}) {
            SCOPED_TRACE(
                cat(gemm_form ? "GEMM form" : "per-row kernel", blocks ? " in blocks" : ""));
            DeviceArray<float> dwo(T * HI), dk(T * dI);
            DeviceArray<bf16> dq(T * HI * dI);
            const int64_t step = blocks ? block : T;
            if (blocks) cuda::fill(ctx(), dk, T * dI, 0.f);  // the blocks add into it
            for (int64_t t0 = 0; t0 < T; t0 += step) {
                const int64_t n = std::min(step, T - t0), keys = t0 + n;
                DeviceArray<float> dpart(block_rows(dpois, t0, n, keys));
                // Three chunks of query rows per call in the GEMM form.
                const int64_t ws_bytes =
                    cuda::indexer_scores_backward_bytes_per_token(keys, HI) * ((n + 2) / 3);
                ASSERT_LE(ws_bytes, per_token * ((T + 2) / 3));
                cuda::indexer_scores_backward(ctx(),
                                              {.sparse = sparse,
                                               .q = q.dev + t0 * HI * dI,
                                               .k = k.dev,
                                               .w = dw_in + t0 * HI,
                                               .dscore = dpart,
                                               .grad_scale = g,
                                               .idx = didx + t0 * K,
                                               .len = dlen + t0,
                                               .kslots = K,
                                               .row_begin = rb + t0,
                                               .tokens = n,
                                               .heads = HI,
                                               .dim = dI,
                                               .first_row = t0,
                                               .add_dk = blocks,
                                               .form = gemm_form ? cuda::IndexerBackwardForm::Gemm
                                                                 : cuda::IndexerBackwardForm::Rows,
                                               .workspace = gemm_form ? ws.get() : nullptr,
                                               .workspace_bytes = ws_bytes},
                                              dwo + t0 * HI, dq + t0 * HI * dI, dk);
            }
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

#endif  // SPARSETRON_WITH_CUDA
