// The harness's perf mode (DESIGN §4): each op at the GLM-5.2 proxy's shapes (one 4096-token
// micro-batch), timed with CUDA events: median µs, TFLOP/s by the op's FLOP count and GB/s by the
// bytes it must move at least. Its own binary, ops_perf: figures, not tests (no ctest entry; the
// op families' tests check correctness); googletest only drives it (--gtest_filter picks ops).
// Inputs are constant-filled or random where values steer the work (the top-k's bins, the flash
// attention's running maximum): timing, not correctness (the other harness tests check
// correctness).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <utility>

#include "gpu/harness.h"

#if SPARSETRON_WITH_CUDA
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/cuda/device_caps.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/indexer/indexer_forms.h"
#include "sparsetron/ops/loss/loss.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/ops/norm/norm.h"
#include "sparsetron/ops/optim/muon_batch.h"
#include "sparsetron/ops/optim/optim.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaOpsPerf, Skipped) {
    GTEST_SKIP() << "built without CUDA: the perf mode runs on the GPU machine";
}
#else

namespace {

constexpr int64_t T = 4096, h = 6144, H = 64, L = 576, kr = 512, K = 2048, V = 154880;

// Sparse MQA over `tokens` tokens of one document, row t selecting its last min(t + 1, 2048) keys;
// report_gathered_sparse_mqa() times the gathered forward and backward and, where supported, the
// flash wgmma forward and backward. FLOPs on the selected pairs (absorbed: 576 + 512 per pair and
// head; backward 2.5x).
struct SparseMqaBench {
    int64_t tokens = 0;
    std::unique_ptr<DeviceArray<bf16>> q, kv, o, dout, dq;
    std::unique_ptr<DeviceArray<float>> lse, dkv, psum;
    std::unique_ptr<DeviceArray<int32_t>> idx, len;
    double pairs = 0;
    const float scale = 0.0417f;

    double fwd_flops() const { return 2.0 * H * pairs * (L + kr); }
    double fwd_bytes() const { return 2.0 * (tokens * H * (L + kr) + pairs * L); }
    double bwd_bytes() const { return 2.0 * (2 * tokens * H * (L + kr) + pairs * L); }
    cuda::SparseMqa problem() const { return {tokens, H, L, kr, *q, *kv, *idx, *len, K, scale}; }
    // The plan of `form` at this shape; masked forms with `ws_bytes` of workspace and `saved`
    // probabilities kept (the buffers given to forward / backward).
    cuda::SparseAttentionPlan plan(cuda::SparseAttentionForm form, int64_t ws_bytes = 0,
                                   int64_t saved = 0) const {
        cuda::SparseAttentionPlan p = cuda::plan_sparse_attention({.tokens = tokens,
                                                                   .heads = H,
                                                                   .dqk = L,
                                                                   .dv = kr,
                                                                   .topk = K,
                                                                   .sm90a = cuda::has_sm90a()},
                                                                  form);
        if (ws_bytes > 0) p.workspace_bytes = ws_bytes;
        p.saved_probs_elems = saved;
        return p;
    }
    // Where the flash kernels run, else the tensor-core ones: the gathered forms.
    cuda::SparseAttentionForm gathered() const {
        return cuda::has_sm90a() ? cuda::SparseAttentionForm::AbsorbedFlash
                                 : cuda::SparseAttentionForm::AbsorbedGathered;
    }
    void forward(const ExecContext& ctx, const cuda::SparseAttentionPlan& p, void* ws = nullptr,
                 bf16* saved = nullptr) const {
        cuda::sparse_mqa_forward(ctx, p, problem(), *o, *lse, *psum, {ws, saved});
    }
    void backward(const ExecContext& ctx, const cuda::SparseAttentionPlan& p, void* ws = nullptr,
                  bf16* saved = nullptr) const {
        cuda::sparse_mqa_backward(ctx, p, problem(), *o, *lse, *dout, *dq, *dkv, {ws, saved});
    }
};

}  // namespace

class CudaOpsPerf : public ::testing::Test {
  protected:
    void SetUp() override {
        if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
        session_ = std::make_unique<cuda::CudaSession>();
    }
    const ExecContext& ctx() const { return session_->ctx(); }
    // A bf16 device buffer filled with `v` (through an fp32 staging buffer on the device).
    std::unique_ptr<DeviceArray<bf16>> bf(int64_t n, float v = 0.01f) {
        auto out = std::make_unique<DeviceArray<bf16>>(n);
        DeviceArray<float> tmp(n);
        cuda::fill(ctx(), tmp, n, v);
        cuda::f32_to_bf16(ctx(), tmp, *out, n);
        session_->synchronize();
        return out;
    }
    // Random buffers, where the values steer the work (the indexer's top-k: constant scores would
    // put every key in one radix bin).
    std::unique_ptr<DeviceArray<bf16>> bf_random(int64_t n, uint64_t seed) {
        auto host = random_vector<float>(n, seed);
        return std::make_unique<DeviceArray<bf16>>(to_bf16_rounding(host));
    }
    // Random bf16 in [-1, 1] without an n-long host vector: one 4M-element random block repeated.
    std::unique_ptr<DeviceArray<bf16>> bf_tiled_random(int64_t n, uint64_t seed) {
        auto out = std::make_unique<DeviceArray<bf16>>(n);
        auto block = random_vector<float>(size_t(std::min<int64_t>(n, int64_t(1) << 22)), seed);
        const auto rounded = to_bf16_rounding(block);
        for (int64_t off = 0; off < n; off += int64_t(rounded.size()))
            copy_to_device(
                out->get() + off, rounded.data(),
                size_t(std::min<int64_t>(int64_t(rounded.size()), n - off)) * sizeof(bf16));
        return out;
    }
    std::unique_ptr<DeviceArray<float>> f32_random(int64_t n, uint64_t seed) {
        return std::make_unique<DeviceArray<float>>(random_vector<float>(n, seed));
    }
    std::unique_ptr<DeviceArray<float>> f32(int64_t n, float v = 0.01f) {
        auto out = std::make_unique<DeviceArray<float>>(n);
        cuda::fill(ctx(), *out, n, v);
        return out;
    }
    // SPARSETRON_OPS_PERF_LINES=TEXT (the test binary's, not the engine's) times only the lines
    // whose name contains TEXT (a device call that needs a few lines of a test skips the rest).
    void report(const std::string& op, const std::function<void()>& fn, double flops,
                double bytes) {
        static const char* only = std::getenv("SPARSETRON_OPS_PERF_LINES");
        if (only && op.find(only) == std::string::npos) return;
        auto ms = session_->time_ms(fn, 10);
        std::sort(ms.begin(), ms.end());
        const double med = ms[ms.size() / 2];
        std::cout << "[perf] " << std::left << std::setw(44) << op << std::right << std::fixed
                  << std::setprecision(1) << std::setw(10) << med * 1e3 << " us  " << std::setw(7)
                  << (flops > 0 ? flops / (med * 1e-3) / 1e12 : 0.0) << " TFLOP/s  " << std::setw(7)
                  << bytes / (med * 1e-3) / 1e9 << " GB/s\n";
    }
    SparseMqaBench sparse_mqa_bench(int64_t tokens) {
        SparseMqaBench b;
        b.tokens = tokens;
        // Random q and kv: the flash forward's running maximum moves with the data.
        b.q = bf_tiled_random(tokens * H * L, 51), b.kv = bf_tiled_random(tokens * L, 52);
        b.o = bf(tokens * H * kr);
        b.dout = bf(tokens * H * kr), b.dq = bf(tokens * H * L);
        b.lse = f32(H * tokens), b.dkv = f32(tokens * L), b.psum = f32(tokens * K);
        std::vector<int32_t> idx(tokens * K, -1), len(tokens);
        for (int64_t t = 0; t < tokens; ++t) {
            const int64_t nk = std::min<int64_t>(t + 1, K);
            for (int64_t j = 0; j < nk; ++j) idx[t * K + j] = int32_t(t + 1 - nk + j);
            len[t] = int32_t(nk);
            b.pairs += double(nk);
        }
        b.idx = std::make_unique<DeviceArray<int32_t>>(idx);
        b.len = std::make_unique<DeviceArray<int32_t>>(len);
        return b;
    }
    void report_gathered_sparse_mqa(const SparseMqaBench& b, const std::string& prefix) {
        report(
            prefix + "sparse mqa fwd (gathered, selected pairs)",
            [&] { b.forward(ctx(), b.plan(b.gathered())); }, b.fwd_flops(), b.fwd_bytes());
        if (cuda::sparse_mqa_forward_wgmma_supported(H, L, kr)) {
            // The flash kernels: forward without and with the teacher's prob sums; backward in
            // the measured form and the shared-keys one.
            for (float* psum : {static_cast<float*>(nullptr), b.psum->get()})
                report(
                    prefix + (psum ? "sparse mqa fwd, flash wgmma, with prob sums"
                                   : "sparse mqa fwd, flash wgmma (no prob sums)"),
                    [&] { cuda::sparse_mqa_forward_wgmma(ctx(), b.problem(), *b.o, *b.lse, psum); },
                    b.fwd_flops(), b.fwd_bytes());
            report(
                prefix + "sparse mqa bwd, flash wgmma (2.5x fwd count)",
                [&] {
                    cuda::sparse_mqa_backward_wgmma(ctx(), b.problem(), *b.o, *b.lse, *b.dout,
                                                    *b.dq, *b.dkv);
                },
                2.5 * b.fwd_flops(), b.bwd_bytes());
        }
        report(
            prefix + "sparse mqa bwd (gathered, 2.5x fwd count)",
            [&] { b.backward(ctx(), b.plan(b.gathered())); }, 2.5 * b.fwd_flops(), b.bwd_bytes());
    }
    std::unique_ptr<cuda::CudaSession> session_;
};

// The block-scaled FP8 GEMM (1x128 activations x 128x128 weights, cuBLASLt) against the bf16
// GEMM of the same shape, plus the activation quantizer's cost (bytes: bf16 in, e4m3 out).
TEST_F(CudaOpsPerf, Fp8BlockScaledGemmVsBf16) {
    struct Shape {
        const char* name;
        int64_t m, n, k;
    };
    for (const Shape& s :
         {Shape{"8192^3", 8192, 8192, 8192}, Shape{"mlp up 4096x24576x6144", T, 24576, h},
          Shape{"mlp down 4096x6144x12288", T, h, 12288},
          Shape{"o_proj 4096x6144x16384", T, h, 16384}}) {
        auto a = bf(s.m * s.k), w = bf(s.n * s.k), y = bf(s.m * s.n);
        auto wf = f32(s.n * s.k);
        DeviceArray<uint8_t> qa(s.m * s.k), qw(s.n * s.k);
        DeviceArray<float> sa(fp8::scales_1x128(s.m, s.k)), sw(fp8::scales_128x128(s.n, s.k));
        cuda::quantize_fp8_1x128(ctx(), *a, s.m, s.k, s.k, true, qa, sa);
        cuda::quantize_fp8_128x128(ctx(), *wf, s.n, s.k, true, qw, sw);
        const double flops = 2.0 * s.m * s.n * s.k;
        report(
            cat("gemm bf16 ", s.name),
            [&] {
                cuda::gemm(ctx(), false, true, s.m, s.n, s.k, 1.f, *a, s.k, *w, s.k, 0.f, *y, s.n);
            },
            flops, 2.0 * (s.m * s.k + s.n * s.k + s.m * s.n));
        report(
            cat("gemm fp8 1x128.128x128 ", s.name),
            [&] {
                cuda::gemm_fp8_blockwise(ctx(), s.m, s.n, s.k, {qa, sa, false}, {qw, sw, true}, *y,
                                         s.n);
            },
            flops, double(s.m * s.k + s.n * s.k) + 2.0 * s.m * s.n);
        report(
            cat("quantize 1x128 ", s.m, "x", s.k),
            [&] { cuda::quantize_fp8_1x128(ctx(), *a, s.m, s.k, s.k, true, qa, sa); }, 0,
            3.0 * s.m * s.k);
    }
}

TEST_F(CudaOpsPerf, DenseGemmsAndElementwise) {
    auto a = bf(T * 16384), w = bf(h * 16384), y = bf(T * h);
    report(
        "gemm o_proj 4096x6144x16384 bf16",
        [&] { cuda::gemm(ctx(), false, true, T, h, 16384, 1.f, *a, 16384, *w, 16384, 0.f, *y, h); },
        2.0 * T * h * 16384, 2.0 * (T * 16384 + h * 16384 + T * h));
    auto x = bf(T * h), nw = bf(h), out = bf(T * h);
    auto rstd = f32(T);
    report(
        "rmsnorm 4096x6144",
        [&] { cuda::rmsnorm_forward(ctx(), *x, h, *nw, T, h, 1e-5f, *out, h, *rstd); }, 0,
        2.0 * 2 * T * h);
    auto g = bf(T * 12288), u = bf(T * 12288), act = bf(T * 12288);
    report(
        "swiglu 4096x12288", [&] { cuda::swiglu_forward(ctx(), *g, *u, T * 12288, *act); }, 0,
        3.0 * 2 * T * 12288);
    const int64_t n = 100'000'000;
    auto p = f32(n), gr = f32(n), m = f32(n), v = f32(n);
    report(
        "adamw 100M parameters",
        [&] {
            cuda::adamw_update(ctx(), {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3}, *p, *gr, *m, *v, n,
                               nullptr, nullptr, nullptr);
        },
        0, 4.0 * 7 * n);
}

TEST_F(CudaOpsPerf, HeadCrossEntropyChunk) {
    const int64_t rows = 512;
    auto hh = bf(rows * h), w = bf(V * h), dh = bf(rows * h), dl = bf(rows * V);
    auto logits = f32(rows * V), row_loss = f32(rows), dw = f32(V * h, 0.f);
    std::vector<int32_t> tg(rows);
    for (int64_t i = 0; i < rows; ++i) tg[i] = int32_t(i * 97 % V);
    DeviceArray<int32_t> targets(tg);
    report(
        "head + CE fwd+bwd, 512 rows x 154880",
        [&] {
            cuda::head_cross_entropy(
                ctx(), {*hh, rows, h, *w, V, targets, rows, *logits, *dl, rows, 1e-3f}, *row_loss,
                *dh, *dw);
        },
        3 * 2.0 * rows * h * V, 2.0 * V * h + 4.0 * V * h + 6.0 * rows * V);
    // The engine's form at the proxy's 4096 rows (chunks of 512 rows, the weight gradient one
    // GEMM over every row's dlogits) against its three GEMMs alone at the same shapes (the
    // fused head + loss is meant to run at >= 80% of the plain GEMMs' rate).
    const int64_t R = T, chunk = 512;
    auto hr = bf(R * h), dhr = bf(R * h), dlr = bf(R * V);
    auto logits_all = f32(R * V), loss_r = f32(R);
    std::vector<int32_t> tgr(R);
    for (int64_t i = 0; i < R; ++i) tgr[i] = int32_t(i * 97 % V);
    DeviceArray<int32_t> targets_r(tgr);
    report(
        "head + CE fwd+bwd, 4096 rows, chunks of 512",
        [&] {
            cuda::head_cross_entropy(ctx(),
                                     {*hr, R, h, *w, V, targets_r, chunk, *logits_all, *dlr,
                                      cuda::head_dlogits_rows(R, chunk, h), 1e-3f},
                                     *loss_r, *dhr, *dw);
        },
        3 * 2.0 * R * h * V, 2.0 * V * h + 4.0 * V * h + 6.0 * R * V);
    report(
        "head GEMMs alone (logits, dX, dW), 4096 rows",
        [&] {
            cuda::gemm(ctx(), false, true, R, V, h, 1.f, *hr, h, *w, h, 0.f, *logits_all, V,
                       DType::BF16, DType::F32);
            cuda::gemm(ctx(), false, false, R, h, V, 1.f, *dlr, V, *w, h, 0.f, *dhr, h);
            cuda::gemm(ctx(), true, false, V, h, R, 1.f, *dlr, V, *hr, h, 1.f, *dw, h, DType::BF16,
                       DType::F32);
        },
        3 * 2.0 * R * h * V, 2.0 * V * h + 4.0 * V * h + 8.0 * R * V);
}

TEST_F(CudaOpsPerf, SparseMqaAndIndexerAtTopk2048) {
    const SparseMqaBench b = sparse_mqa_bench(T);
    report_gathered_sparse_mqa(b, "");
    // The same function as masked dense GEMMs (the model's choice at T <= 2 k); FLOPs are still
    // counted on the selected pairs, so the TFLOP/s compare directly with the lines above.
    const cuda::SparseAttentionPlan masked = b.plan(cuda::SparseAttentionForm::AbsorbedMasked);
    const int64_t ws_bytes = masked.workspace_bytes;
    ASSERT_GT(ws_bytes, 0);
    auto ws = f32((ws_bytes + 3) / 4);
    report(
        "sparse mqa fwd, masked dense (selected pairs)", [&] { b.forward(ctx(), masked, *ws); },
        b.fwd_flops(), b.fwd_bytes());
    report(
        "sparse mqa bwd, masked dense (selected pairs)", [&] { b.backward(ctx(), masked, *ws); },
        2.5 * b.fwd_flops(), b.bwd_bytes());
    // With the forward's probabilities kept (the model's choice when a layer's fit
    // dsa_saved_probs_max_mib): the forward writes P into the saved buffer, the backward skips
    // the second score GEMM and the probability kernel.
    const int64_t saved_elems = cuda::sparse_mqa_saved_probs_elems(T, H, ws_bytes);
    auto saved = bf(saved_elems);
    const cuda::SparseAttentionPlan kept =
        b.plan(cuda::SparseAttentionForm::AbsorbedMasked, ws_bytes, saved_elems);
    report(
        "sparse mqa fwd, masked, probabilities kept", [&] { b.forward(ctx(), kept, *ws, *saved); },
        b.fwd_flops(), b.fwd_bytes());
    report(
        "sparse mqa bwd, masked, from kept probabilities",
        [&] { b.backward(ctx(), kept, *ws, *saved); }, 2.5 * b.fwd_flops(), b.bwd_bytes());
    // Smaller chunks of query tokens: S and P of a chunk stay in L2 between the GEMM that
    // writes them and the kernel that reads them, at the price of more, smaller GEMMs.
    const int64_t per_token = H * T * 10;  // S, dP fp32 + P bf16 per query token (T % 16 == 0)
    for (int64_t cq : {128, 64, 32, 16}) {
        report(
            "masked fwd+bwd, chunks of " + std::to_string(cq) + " tokens",
            [&] {
                const auto p = b.plan(cuda::SparseAttentionForm::AbsorbedMasked, cq * per_token);
                b.forward(ctx(), p, *ws);
                b.backward(ctx(), p, *ws);
            },
            3.5 * b.fwd_flops(), 0);
    }
    const int64_t HI = 32, dI = 128;
    auto qi = bf_random(T * HI * dI, 31), ki = bf_random(T * dI, 32);
    auto wi = f32_random(T * HI, 33), scores = f32(T * T);
    std::vector<int32_t> rb(T, 0);
    DeviceArray<int32_t> row_begin(rb), tk(T * K), tl(T);
    report(
        "indexer scores (causal pairs x 32 x 128)",
        [&] {
            cuda::indexer_scores(
                ctx(),
                cuda::has_sm90a() ? cuda::IndexerScoresForm::Wgmma : cuda::IndexerScoresForm::Rows,
                *qi, *ki, *wi, row_begin, T, HI, dI, *scores);
        },
        2.0 * HI * dI * (double(T) * (T + 1) / 2), 4.0 * T * T / 2);
    const int64_t dots_bytes = cuda::indexer_scores_workspace_bytes(T, HI);
    auto dots = f32(dots_bytes / 4);
    report(
        "indexer scores, cuBLASLt dots (causal pairs)",
        [&] {
            cuda::indexer_scores_gemm(ctx(), *qi, *ki, *wi, row_begin, T, HI, dI, *scores, *dots,
                                      dots_bytes);
        },
        2.0 * HI * dI * (double(T) * (T + 1) / 2), 4.0 * T * T / 2);
    if (cuda::indexer_scores_wgmma_supported(HI, dI))
        report(
            "indexer scores, fused wgmma (causal pairs)",
            [&] {
                cuda::indexer_scores_wgmma(ctx(), *qi, *ki, *wi, row_begin, T, HI, dI, *scores);
            },
            2.0 * HI * dI * (double(T) * (T + 1) / 2), 4.0 * T * T / 2);
    report(
        "top-2048 of up to 4096 keys per row",
        [&] { cuda::topk_rows(ctx(), *scores, T, row_begin, T, K, tk, tl); }, 0, 4.0 * T * T / 2);
}

// The 32K sparse MQA point: 32768 tokens with top-2048 (the masked form is not chosen past
// 2 x top-k keys, so the gathered kernels run). Row t selects its last min(t + 1, 2048)
// keys, as at 4K. FLOPs as in the 4K test.
TEST_F(CudaOpsPerf, SparseMqaAt32K) {
    const int64_t T32 = 32768;
    const cuda::SparseAttentionPlan p = cuda::plan_sparse_attention(
        {.tokens = T32, .heads = H, .dqk = L, .dv = kr, .topk = K, .sm90a = cuda::has_sm90a()});
    ASSERT_EQ(p.workspace_bytes, 0) << "32K takes a gathered form: " << p.describe();
    report_gathered_sparse_mqa(sparse_mqa_bench(T32), "32K ");
}

// Issue 7's 32K indexer point: scores over every causal pair, then the top-2048 of each row.
TEST_F(CudaOpsPerf, IndexerAt32K) {
    const int64_t T32 = 32768;
    const int64_t HI = 32, dI = 128;
    auto qi = bf_random(T32 * HI * dI, 41), ki = bf_random(T32 * dI, 42);
    auto wi = f32_random(T32 * HI, 43), scores = f32(T32 * T32);
    std::vector<int32_t> rb(T32, 0);
    DeviceArray<int32_t> row_begin(rb), tk(T32 * K), tl(T32);
    const int64_t dots_bytes = cuda::indexer_scores_workspace_bytes(T32, HI);
    auto dots = f32(dots_bytes / 4);
    const double causal = double(T32) * (T32 + 1) / 2;
    report(
        "32K indexer scores, cuBLASLt dots (causal pairs)",
        [&] {
            cuda::indexer_scores_gemm(ctx(), *qi, *ki, *wi, row_begin, T32, HI, dI, *scores, *dots,
                                      dots_bytes);
        },
        2.0 * HI * dI * causal, 4.0 * causal);
    if (cuda::indexer_scores_wgmma_supported(HI, dI))
        report(
            "32K indexer scores, fused wgmma (causal pairs)",
            [&] {
                cuda::indexer_scores_wgmma(ctx(), *qi, *ki, *wi, row_begin, T32, HI, dI, *scores);
            },
            2.0 * HI * dI * causal, 4.0 * causal);
    report(
        "32K top-2048 of up to 32768 keys per row",
        [&] { cuda::topk_rows(ctx(), *scores, T32, row_begin, T32, K, tk, tl); }, 0, 4.0 * causal);
    // The pair as the engine runs it (the plan picks the fused kernel where it applies).
    const cuda::IndexerScoresForm form =
        cuda::plan_indexer({.tokens = T32, .heads = HI, .dim = dI, .sm90a = cuda::has_sm90a()})
            .scores;
    report(
        "32K indexer scores + top-2048 (a layer's selection)",
        [&] {
            cuda::indexer_scores(ctx(), form, *qi, *ki, *wi, row_begin, T32, HI, dI, *scores, *dots,
                                 dots_bytes);
            cuda::topk_rows(ctx(), *scores, T32, row_begin, T32, K, tk, tl);
        },
        2.0 * HI * dI * causal, 8.0 * causal);
}

TEST_F(CudaOpsPerf, GroupedExpertGemm) {
    // 16 experts x 2048 rows (uniform top-8 routing of 4096 tokens), 6144 -> 2048.
    const int64_t E = 16, rows = 2048, F = 2048;
    std::vector<int32_t> off(E + 1);
    for (int64_t e = 0; e <= E; ++e) off[e] = int32_t(e * rows);
    DeviceArray<int32_t> doff(off);
    auto x = bf(E * rows * h), w = bf(E * F * h), y = bf(E * rows * F);
    auto dw = f32(E * F * h, 0.f);
    using K2 = cuda::GroupedGemm;
    // The engine's path for each kind under one routing (`offs`): x W^T (x -> y), dy W (y -> x),
    // weight gradient (dW = y^T x, a step's first write of it); all with n = F, k = h.
    const double flops = 2.0 * E * rows * F * h;
    const double bytes = 2.0 * (E * rows * h + E * F * h + E * rows * F);
    const double wgrad_bytes = 2.0 * (E * rows * h + E * rows * F) + 4.0 * E * F * h;
    const double wgrad_add_bytes = wgrad_bytes + 4.0 * E * F * h;  // dW read too
    auto each_kind = [&](const std::string& xw_name, const std::string& suffix,
                         const int32_t* offs) {
        report(
            xw_name,
            [&] {
                cuda::grouped_gemm(ctx(),
                                   {K2::RowsTimesWeightT, offs, E, T, E * rows, F, h, *x, *w, *y});
            },
            flops, bytes);
        report(
            "grouped gemm dy W" + suffix,
            [&] {
                cuda::grouped_gemm(ctx(),
                                   {K2::RowsTimesWeight, offs, E, T, E * rows, F, h, *y, *w, *x});
            },
            flops, bytes);
        report(
            "grouped gemm weight grad" + suffix,
            [&] {
                cuda::grouped_gemm(ctx(),
                                   {K2::WeightGrad, offs, E, T, E * rows, F, h, *y, *x, *dw});
            },
            flops, wgrad_bytes);
    };
    each_kind("grouped gemm x W^T, 16 x 2048 x 6144 -> 2048", "", doff);
    report(
        "grouped gemm weight grad, adding (dW +=)",
        [&] {
            cuda::grouped_gemm(ctx(),
                               {K2::WeightGrad, doff, E, T, E * rows, F, h, *y, *x, *dw, 0, true});
        },
        flops, wgrad_add_bytes);
    // Skewed routing: half the experts get 3x the rows of the other half (3072 / 1024; the same
    // 32768 rows), through the engine's path, each kind.
    std::vector<int32_t> skew(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) skew[e + 1] = skew[e] + int32_t(e % 2 ? 1024 : 3072);
    DeviceArray<int32_t> dskew(skew);
    each_kind("grouped gemm x W^T, skewed 3072/1024 rows", ", skewed", dskew);
    // Ragged routing: 2011 / 2085 rows alternating (the same 32768), so every expert ends inside
    // a 64-row slice, as routing does in training: the weight gradient's last slice of each tile
    // is partial.
    std::vector<int32_t> ragged(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) ragged[e + 1] = ragged[e] + int32_t(e % 2 ? 2085 : 2011);
    DeviceArray<int32_t> dragged(ragged);
    each_kind("grouped gemm x W^T, ragged 2011/2085 rows", ", ragged", dragged);
    // Training's routing: the first MoE layer's loads in the proxy's first step (train
    // --device cuda, mtp_num_layers=0; recorded in bench/results/),
    // 513 to 3343 rows, the same 32768 in all.
    const std::vector<int32_t> loads = {3343, 2027, 1513, 1413, 2180, 3230, 2079, 1717,
                                        2719, 2388, 1520, 2772, 1895, 1064, 2395, 513};
    std::vector<int32_t> trained(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) trained[e + 1] = trained[e] + loads[size_t(e)];
    ASSERT_EQ(trained[E], E * rows);
    DeviceArray<int32_t> dtrained(trained);
    each_kind("grouped gemm x W^T, training routing", ", training routing", dtrained);
    auto a = bf(E * rows * h), b = bf(h * F), c = bf(E * rows * F);
    report(
        "dense cuBLASLt gemm of the same total shape",
        [&] { cuda::gemm(ctx(), false, true, E * rows, F, h, 1.f, *a, h, *b, h, 0.f, *c, F); },
        2.0 * E * rows * F * h, 2.0 * (E * rows * h + F * h + E * rows * F));
    // Each kind's own dense counterpart (the line above is x W^T's): dy W as one [32768 x 2048]
    // x [2048 x 6144] GEMM (K = 2048, bf16 out); the weight gradient as 16 batched [2048 x 2048]^T
    // x [2048 x 6144] GEMMs added into fp32 (K = one expert's 2048 rows).
    report(
        "dense cuBLASLt gemm, dy W's shape",
        [&] { cuda::gemm(ctx(), false, false, E * rows, h, F, 1.f, *c, F, *b, h, 0.f, *a, h); },
        2.0 * E * rows * F * h, 2.0 * (E * rows * F + F * h + E * rows * h));
    for (const bool add : {true, false})  // dW += (reads dW too) and dW = (a step's first write)
        report(
            cat("dense cuBLASLt gemm, weight grad's shape (16 batched, fp32 ", add ? "+=" : "=",
                ")"),
            [&] {
                cuda::gemm(ctx(), true, false, F, h, rows, 1.f, *c, F, *a, h, add ? 1.f : 0.f, *dw,
                           h, DType::BF16, DType::F32, {E, rows * F, rows * h, F * h});
            },
            2.0 * E * rows * F * h, add ? wgrad_add_bytes : wgrad_bytes);
}

// The FP8 linears' quantizers at the proxy's dense shapes (4096 tokens): activations 1x128 along
// the rows (the forward and input-gradient GEMMs' operand) and down the columns (the weight
// gradient's), and a weight's W and W^T from its fp32 master (o_proj, 6144 x 16384).
TEST_F(CudaOpsPerf, Fp8Quantizers) {
    const int64_t wide = 16384;
    auto x = bf_tiled_random(T * wide, 81);
    auto w = f32_random(h * wide, 82);
    DeviceArray<uint8_t> q(h * wide), qt(h * wide);  // h > T: room for either
    DeviceArray<float> s(fp8::scales_1x128(wide, T)), st(fp8::scales_128x128(wide, h));
    for (const int64_t k : {h, wide}) {
        report(
            cat("fp8 quantize 1x128 rows ", T, "x", k),
            [&] { cuda::quantize_fp8_1x128(ctx(), *x, T, k, k, true, q, s); }, 0, 3.0 * T * k);
        report(
            cat("fp8 quantize 1x128 columns ", T, "x", k),
            [&] { cuda::quantize_fp8_1x128_columns(ctx(), *x, T, k, k, true, q, s); }, 0,
            3.0 * T * k);
    }
    report(
        cat("fp8 quantize W and W^T ", h, "x", wide),
        [&] { cuda::quantize_fp8_128x128_both(ctx(), *w, h, wide, true, q, s, qt, st); }, 0,
        6.0 * h * wide);
}

// What the routed experts' FP8 inputs cost per MoE application at the proxy's shape (4096 tokens,
// top-8: 32768 rows): each producer kernel (gather, SwiGLU forward and backward, combine
// backward) alone and writing the FP8 copy of its output in the same pass, beside the separate
// 1x128 passes that copy replaces.
TEST_F(CudaOpsPerf, MoeProducersFp8) {
    const int64_t k = 8, R = T * k, F = 2048, E = 16;
    std::vector<int32_t> offsets(E + 1), slot_row(R), perm_token(R);
    for (int64_t e = 0; e <= E; ++e) offsets[size_t(e)] = int32_t(e * R / E);
    for (int64_t i = 0; i < R; ++i) {  // 7919 is prime: a permutation of the rows
        slot_row[size_t(i)] = int32_t(i * 7919 % R);
        perm_token[size_t(slot_row[size_t(i)])] = int32_t(i / k);
    }
    DeviceArray<int32_t> doff(offsets), dslot(slot_row), dperm(perm_token);
    auto gates = f32_random(R, 71);
    auto x = bf_tiled_random(T * h, 72), dy = bf_tiled_random(T * h, 73);
    auto rows_h = bf_tiled_random(R * h, 74), out_h = bf(R * h);
    auto g = bf_tiled_random(R * F, 75), u = bf_tiled_random(R * F, 76),
         d = bf_tiled_random(R * F, 77), a = bf(R * F), b = bf(R * F);
    auto dgates = f32(R);
    DeviceArray<uint8_t> q0(R * h), q1(R * F);
    DeviceArray<float> s0(fp8::scales_1x128(R, h)), s1(fp8::scales_1x128(R, F));
    const cuda::Fp8RowsOut h8{q0, s0, R, true}, f8{q0, s0, R, true}, f8b{q1, s1, R, true};
    const double row_h = 2.0 * R * h, row_f = 2.0 * R * F;  // bytes of one bf16 row set
    report(
        "moe gather 32768 x 6144",
        [&] { cuda::moe_gather(ctx(), *x, dperm, doff, E, R, h, *out_h); }, 0, 2 * row_h);
    report(
        "moe gather + fp8 copy",
        [&] { cuda::moe_gather(ctx(), *x, dperm, doff, E, R, h, *out_h, h8); }, 0, 2.5 * row_h);
    report(
        "quantize 1x128 32768 x 6144 (separate)",
        [&] { cuda::quantize_fp8_1x128(ctx(), *rows_h, R, h, h, true, q0, s0); }, 0, 1.5 * row_h);
    report(
        "moe combine backward 32768 x 6144",
        [&] {
            cuda::moe_combine_backward(ctx(), *dy, *rows_h, dslot, *gates, T, k, h, *out_h,
                                       *dgates);
        },
        0, 3 * row_h);
    report(
        "moe combine backward + fp8 copy",
        [&] {
            cuda::moe_combine_backward(ctx(), *dy, *rows_h, dslot, *gates, T, k, h, *out_h, *dgates,
                                       h8);
        },
        0, 3.5 * row_h);
    report(
        "swiglu forward 32768 x 2048", [&] { cuda::swiglu_forward(ctx(), *g, *u, R * F, *a); }, 0,
        3 * row_f);
    report(
        "swiglu forward + fp8 copy", [&] { cuda::swiglu_forward(ctx(), *g, *u, R, F, *a, f8); }, 0,
        3.5 * row_f);
    report(
        "quantize 1x128 32768 x 2048 (separate)",
        [&] { cuda::quantize_fp8_1x128(ctx(), *g, R, F, F, true, q1, s1); }, 0, 1.5 * row_f);
    report(
        "swiglu backward 32768 x 2048",
        [&] { cuda::swiglu_backward(ctx(), *g, *u, *d, R * F, *a, *b); }, 0, 5 * row_f);
    report(
        "swiglu backward + fp8 copies",
        [&] { cuda::swiglu_backward(ctx(), *g, *u, *d, R, F, *a, *b, f8, f8b); }, 0, 6 * row_f);
}

// The routed experts' FP8 grouped GEMM (grouped_gemm_fp8) against the engine's bf16 grouped GEMM
// and cuBLASLt's block-scaled FP8 GEMM of the same total shape (its ceiling here), both expert
// shapes of the proxy (gate / up 6144 -> 2048, down 2048 -> 6144), uniform and training's
// routing; then what FP8 adds per use: the 1x128 quantization of the permuted rows and the
// per-step quantization of one expert matrix set from the fp32 masters (W and W^T).
TEST_F(CudaOpsPerf, GroupedExpertGemmFp8) {
    if (!cuda::grouped_gemm_fp8_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs sm_90a";
    const int64_t E = 16, rows = 2048, F = 2048, R = E * rows;
    std::vector<int32_t> uniform(E + 1), trained(E + 1, 0);
    const std::vector<int32_t> loads = {3343, 2027, 1513, 1413, 2180, 3230, 2079, 1717,
                                        2719, 2388, 1520, 2772, 1895, 1064, 2395, 513};
    for (int64_t e = 0; e <= E; ++e) uniform[e] = int32_t(e * rows);
    for (int64_t e = 0; e < E; ++e) trained[e + 1] = trained[e] + loads[size_t(e)];
    DeviceArray<int32_t> duniform(uniform), dtrained(trained);
    auto x = bf_tiled_random(R * h, 61), y = bf(R * h);
    auto wb = bf(E * F * h);
    auto w32 = f32_random(E * F * h, 62);
    DeviceArray<uint8_t> qx(R * h), qw(E * F * h), qwt(E * F * h);
    const int64_t ws = fp8::scales_128x128(F, h), wst = fp8::scales_128x128(h, F);
    DeviceArray<float> sx(std::max(fp8::scales_1x128(R, h), fp8::scales_1x128(R, F))), sw(E * ws),
        swt(E * wst);
    auto quantize_weights = [&] {
        for (int64_t e = 0; e < E; ++e)
            cuda::quantize_fp8_128x128_both(ctx(), w32->get() + e * F * h, F, h, true,
                                            qw.get() + e * F * h, sw.get() + e * ws,
                                            qwt.get() + e * F * h, swt.get() + e * wst);
    };
    quantize_weights();
    using K2 = cuda::GroupedGemm;
    const double flops = 2.0 * R * F * h;
    for (int64_t k : {h, F}) {
        const int64_t n = k == h ? F : h;  // gate / up: 6144 -> 2048; down: 2048 -> 6144
        const std::string shape = cat(E, " x ", rows, " x ", k, " -> ", n);
        cuda::quantize_fp8_1x128(ctx(), *x, R, k, k, true, qx, sx);
        const cuda::Fp8Operand wq =
            k == h ? cuda::Fp8Operand{qw, sw, true} : cuda::Fp8Operand{qwt, swt, true};
        for (const auto& [name, offs] :
             {std::pair<std::string, const int32_t*>{"uniform", duniform},
              std::pair<std::string, const int32_t*>{"training routing", dtrained}}) {
            report(
                cat("grouped bf16 x W^T ", shape, ", ", name),
                [&] {
                    cuda::grouped_gemm(ctx(),
                                       {K2::RowsTimesWeightT, offs, E, T, R, n, k, *x, *wb, *y});
                },
                flops, 2.0 * (R * k + E * n * k + R * n));
            report(
                cat("grouped fp8 x W^T ", shape, ", ", name),
                [&] {
                    cuda::grouped_gemm_fp8(ctx(), {offs, E, T, R, n, k, {qx, sx, false}, wq, *y});
                },
                flops, double(R * k + E * n * k) + 2.0 * R * n);
        }
        report(
            cat("dense cuBLASLt fp8 1x128.128x128 ", R, " x ", k, " -> ", n),
            [&] {
                cuda::gemm_fp8_blockwise(ctx(), R, n, k, {qx, sx, false}, wq, *y, n);
            },
            flops, double(R * k + n * k) + 2.0 * R * n);
        report(
            cat("quantize 1x128 ", R, "x", k),
            [&] { cuda::quantize_fp8_1x128(ctx(), *x, R, k, k, true, qx, sx); }, 0, 3.0 * R * k);
    }
    // The experts' weight gradient dW [E][F][h] = dy^T x (dy [R, F], x [R, h]): bf16 against FP8
    // (operands quantized per expert segment along the tokens, then the FP8 GEMM), both writing
    // fp32 dW, uniform and training's routing.
    {
        auto dy = bf_tiled_random(R * F, 63);
        auto dw = f32(E * F * h, 0.f);
        const int64_t padded = fp8::expert_columns_padded(R, E);
        DeviceArray<uint8_t> qdyt(F * padded), qxt(h * padded);
        DeviceArray<float> sdyt(fp8::scales_1x128(F, padded)), sxt(fp8::scales_1x128(h, padded));
        for (const auto& [name, offs] :
             {std::pair<std::string, const int32_t*>{"uniform", duniform},
              std::pair<std::string, const int32_t*>{"training routing", dtrained}}) {
            report(
                cat("grouped bf16 weight grad 16 x 2048 x 6144 x 2048, ", name),
                [&] {
                    cuda::grouped_gemm(ctx(), {K2::WeightGrad, offs, E, T, R, F, h, *dy, *x, *dw});
                },
                flops, 2.0 * (R * h + R * F) + 4.0 * E * F * h);
            auto quantize_both = [&] {
                cuda::quantize_fp8_1x128_expert_columns(ctx(), *dy, offs, E, F, F, padded, true,
                                                        qdyt, sdyt);
                cuda::quantize_fp8_1x128_expert_columns(ctx(), *x, offs, E, h, h, padded, true, qxt,
                                                        sxt);
            };
            quantize_both();
            cuda::Fp8GroupedWeightGrad g;
            g.offsets = offs, g.experts = E, g.n = F, g.k = h, g.padded = padded;
            g.dyt = {qdyt, sdyt, false}, g.xt = {qxt, sxt, false}, g.dw = *dw;
            report(
                cat("grouped fp8 weight grad 16 x 2048 x 6144 x 2048, ", name),
                [&] { cuda::grouped_gemm_fp8_weight_grad(ctx(), g); }, flops,
                double(R * h + R * F) + 4.0 * E * F * h);
            report(cat("quantize expert columns dy and x, ", name), quantize_both, 0,
                   3.0 * (R * h + R * F));
        }
    }
    report("quantize 16 experts' W and W^T (fp32 masters)", quantize_weights, 0, 6.0 * E * F * h);
    report(
        "quantize 16 experts' W and W^T, one launch",
        [&] {
            cuda::quantize_fp8_128x128_both(ctx(), *w32, F, h, true, qw, sw, qwt, swt, E, F * h);
        },
        0, 6.0 * E * F * h);
}

// Muon's gather and normalization for the proxy's largest batch (a layer's 16 routed experts'
// [2048, 6144] matrices; the optimizer's form: momentum updated in the gather, which writes the
// norms' sums of squares too, fp16 Newton-Schulz input). Bytes: the gather reads G and M and
// writes M and the stack (16 per element); the normalization reads the stack and writes fp16 (6).
TEST_F(CudaOpsPerf, MuonGatherAndNormalize) {
    const int64_t E = 16, rows = 2048, cols = h, n = rows * cols;
    auto g = f32_random(E * n, 91), m = f32_random(E * n, 92);
    std::vector<cuda::MuonDeviceProblem> table;
    for (int64_t e = 0; e < E; ++e)
        table.push_back(
            {g->get() + e * n, m->get() + e * n, nullptr, nullptr, 0, rows, rows, 0, 0, nullptr});
    DeviceArray<int64_t> dtable(int64_t(table.size() * sizeof(table[0]) / 8));
    copy_to_device(dtable.get(), table.data(), table.size() * sizeof(table[0]));
    const auto* dt = reinterpret_cast<const cuda::MuonDeviceProblem*>(dtable.get());
    auto scales = f32(1, 1.f), stack = f32(E * n);
    DeviceArray<int32_t> skips(std::vector<int32_t>{0});
    DeviceArray<float> ws(cuda::muon_gathered_norm_floats(E, rows, cols));
    DeviceArray<uint16_t> w(E * n);
    const double el = double(E * n);
    report(
        "muon gather + sums of squares",
        [&] {
            cuda::muon_gather_batch(ctx(), dt, E, rows, cols, false, 0.95f, true, *scales, *stack,
                                    skips, ws);
        },
        0, 16 * el);
    report(
        "muon normalize from the gather's sums",
        [&] {
            cuda::muon_normalize_gathered(ctx(), *stack, E, rows, cols, 1e-7f, ws, DType::F16,
                                          w.get());
        },
        0, 6 * el);
}

#endif  // SPARSETRON_WITH_CUDA
