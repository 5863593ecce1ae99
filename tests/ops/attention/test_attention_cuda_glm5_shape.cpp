// The flash-style wgmma sparse MQA kernels (sparse_mqa_wgmma.cu forward, sparse_mqa_wgmma_bwd.cu
// backward) against the CPU reference at the GLM-5 shape (64 heads, qk 576, v 512), label gpu:
// out, dq and dkv at the bf16 tolerance, lse and the head probability sums at fp32 tolerances (as
// test_attention_cuda.cpp's sparse MQA checks). Rows select 0 keys (padding), fewer than one 64-key
// chunk, exact multiples of it and partial last chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gpu/harness.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/copy/copy.h"
#if SPARSETRON_WITH_CUDA
#include "sparsetron/cuda/cuda_session.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(AttentionCudaGlm5Shape, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op harness runs on the GPU machine";
}
#else

namespace {

constexpr int64_t T = 300, H = 64, dqk = 576, dv = 512, K = 192;

// One document of 290 rows, then 10 padding rows; row t selects a random ascending subset of
// min(K, t + 1) of its keys, except every 7th row which takes exactly 64 or 128 (chunk edges).
// kv row s is multiplied by 1 + growth * s, and the scores by score_mult: with growth, the later
// (larger-index) chunks' scores exceed the running maximum by far more than the forward's
// stale-max margin (2^8), so its accumulator's rescale runs after the first chunk too.
struct Problem {
    std::vector<int32_t> idx, len;
    std::vector<float> qh, kvh;
    float scale;
    Problem(double score_mult, double growth) : idx(T * K, -1), len(T, 0) {
        CounterRng rng(301, 1);
        uint64_t draw = 0;
        for (int64_t t = 0; t < 290; ++t) {
            std::vector<int32_t> cand(t + 1);
            std::iota(cand.begin(), cand.end(), 0);
            for (size_t i = cand.size(); i > 1; --i)
                std::swap(cand[i - 1], cand[rng.bits(draw++) % i]);
            int64_t n = std::min<int64_t>(K, t + 1);
            if (t % 7 == 0 && t >= 128) n = (t / 7) % 2 ? 64 : 128;
            std::sort(cand.begin(), cand.begin() + n);
            std::copy_n(cand.begin(), n, idx.begin() + t * K);
            len[t] = int32_t(n);
        }
        qh = random_vector<float>(T * H * dqk, 302), kvh = random_vector<float>(T * dqk, 303);
        for (int64_t r = 0; r < T; ++r)
            for (int64_t c = 0; c < dqk; ++c) kvh[r * dqk + c] *= float(1 + growth * double(r));
        scale = float(score_mult * 0.9 / std::sqrt(double(dqk)));
    }
    // Head 0's largest score over selected keys j0 .. j1 - 1 of row t (fp64).
    double max_score(int64_t t, int64_t j0, int64_t j1) const {
        double m = -1e300;
        for (int64_t j = j0; j < j1; ++j) {
            double d = 0;
            for (int64_t c = 0; c < dqk; ++c)
                d += double(qh[t * H * dqk + c]) * kvh[idx[t * K + j] * dqk + c];
            m = std::max(m, d * scale);
        }
        return m;
    }
};

bool wgmma_unsupported() {
    return !cuda::sparse_mqa_forward_wgmma_supported(H, dqk, dv);
}

void check_forward(double score_mult, double growth) {
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    Problem pr(score_mult, growth);
    DeviceArray<bf16> q(to_bf16_rounding(pr.qh)), kv(to_bf16_rounding(pr.kvh)), out(T * H * dv);
    DeviceArray<int32_t> didx(pr.idx), dlen(pr.len);
    DeviceArray<float> lse(H * T), psum(T * K);
    cuda::sparse_mqa_forward_wgmma(ctx, {T, H, dqk, dv, q, kv, didx, dlen, K, pr.scale}, out, lse,
                                   psum);
    session.synchronize();
    std::vector<float> o(T * H * dv), l(H * T);
    cpu::sparse_mqa_forward<float>(T, H, dqk, dv, pr.qh.data(), pr.kvh.data(), pr.idx.data(),
                                   pr.len.data(), K, pr.scale, o.data(), l.data());
    if (growth > 0) {
        // The premise: some row's later chunks top its first by more than 2^16 (log2 units).
        double widest = 0;
        for (int64_t t = 0; t < 290; ++t)
            if (pr.len[t] > 128)
                widest =
                    std::max(widest, (pr.max_score(t, 128, pr.len[t]) - pr.max_score(t, 0, 64)) /
                                         std::log(2.0));
        EXPECT_GT(widest, 16.0) << "head 0's later chunks must raise the running maximum";
    }
    const std::string what =
        growth > 0 ? "wgmma sparse mqa (growing scores) " : "wgmma sparse mqa ";
    expect_close(what + "out", to_float(out.download()), o, 1e-2);
    expect_close(what + "lse", lse.download(), l, 1e-5);
    const auto pref = head_prob_sums(pr.qh, pr.kvh, pr.idx, pr.len, l, T, H, dqk, K, pr.scale);
    expect_close(what + "head probability sums", psum.download(), pref, 1e-4);
    // Padding rows: zero output, zero lse.
    const auto og = out.download();
    const auto lg = lse.download();
    int64_t nonzero = 0;
    for (int64_t t = 290; t < T; ++t) {
        for (int64_t i = 0; i < H * dv; ++i) nonzero += bf16_to_float(og[t * H * dv + i]) != 0.f;
        for (int64_t h = 0; h < H; ++h) nonzero += lg[h * T + t] != 0.f;
    }
    EXPECT_EQ(nonzero, 0) << "rows with no selected key";
    expect_guard(out, what + "out");
}

// The backward from the CPU forward's output (rounded to bf16, as the model stores it) and lse,
// against the CPU backward on the same values. extra_key_rows: kv has that many rows past the
// queries' (context parallelism): their dkv rows must come out zero.
void check_backward(double score_mult, double growth, int64_t extra_key_rows) {
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    Problem pr(score_mult, growth);
    const int64_t keys = T + extra_key_rows;
    pr.kvh.resize(keys * dqk, 0.25f);
    const auto qb = to_bf16_rounding(pr.qh), kvb = to_bf16_rounding(pr.kvh);
    std::vector<float> o(T * H * dv), l(H * T);
    cpu::sparse_mqa_forward<float>(T, H, dqk, dv, pr.qh.data(), pr.kvh.data(), pr.idx.data(),
                                   pr.len.data(), K, pr.scale, o.data(), l.data());
    auto doh = random_vector<float>(T * H * dv, 304);
    DeviceArray<bf16> q(qb), kv(kvb), out(to_bf16_rounding(o)), dout(to_bf16_rounding(doh));
    DeviceArray<bf16> dq(T * H * dqk);
    DeviceArray<int32_t> didx(pr.idx), dlen(pr.len);
    DeviceArray<float> lse(l), dkv(keys * dqk);
    cuda::sparse_mqa_backward_wgmma(ctx, {T, H, dqk, dv, q, kv, didx, dlen, K, pr.scale, keys}, out,
                                    lse, dout, dq, dkv);
    session.synchronize();
    std::vector<float> dqr(T * H * dqk), ws(H * T * dqk), dkvr(keys * dqk, 0.f);
    cpu::sparse_mqa_backward<float>(T, H, dqk, dv, pr.qh.data(), pr.kvh.data(), pr.idx.data(),
                                    pr.len.data(), K, pr.scale, o.data(), l.data(), doh.data(),
                                    dqr.data(), ws.data(), dkvr.data());
    const std::string what =
        std::string("wgmma sparse mqa backward") + (growth > 0 ? " (growing scores) " : " ");
    expect_close(what + "dq", to_float(dq.download()), dqr, 1e-2);
    expect_close(what + "dkv", dkv.download(), dkvr, 1e-2);
    expect_guard(dq, what + "dq");
    expect_guard(dkv, what + "dkv");
}

// Query blocks (the model's recompute_block_rows): rows [0, 128) and [128, T) as two problems
// over every key row (key_rows T), each with its own q, out and LSE rows, the second adding its
// keys' gradients into the first's (dkv_accumulate): the CPU's out, LSE, dq and dkv over all rows.
void check_query_blocks() {
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    Problem pr(1.0, 0.0);
    const auto qb = to_bf16_rounding(pr.qh), kvb = to_bf16_rounding(pr.kvh);
    std::vector<float> o(T * H * dv), l(H * T);
    cpu::sparse_mqa_forward<float>(T, H, dqk, dv, pr.qh.data(), pr.kvh.data(), pr.idx.data(),
                                   pr.len.data(), K, pr.scale, o.data(), l.data());
    auto doh = random_vector<float>(T * H * dv, 305);
    const auto ob = to_bf16_rounding(o), dob = to_bf16_rounding(doh);
    std::vector<float> dqr(T * H * dqk), ws(H * T * dqk), dkvr(T * dqk, 0.f);
    cpu::sparse_mqa_backward<float>(T, H, dqk, dv, pr.qh.data(), pr.kvh.data(), pr.idx.data(),
                                    pr.len.data(), K, pr.scale, o.data(), l.data(), doh.data(),
                                    dqr.data(), ws.data(), dkvr.data());
    DeviceArray<bf16> kv(kvb);
    DeviceArray<int32_t> didx(pr.idx), dlen(pr.len);
    DeviceArray<float> dkv(T * dqk);
    std::vector<float> out_all, dq_all, lse_all(H * T);
    const int64_t split = 128;
    for (const int64_t r0 : {int64_t(0), split}) {
        const int64_t n = r0 == 0 ? split : T - split;
        auto rows = [&](const std::vector<bf16>& v, int64_t width) {
            return std::vector<bf16>(v.begin() + r0 * width, v.begin() + (r0 + n) * width);
        };
        DeviceArray<bf16> q(rows(qb, H * dqk)), out(n * H * dv), dout(rows(dob, H * dv));
        DeviceArray<bf16> dq(n * H * dqk);
        DeviceArray<float> lse(H * n);
        const cuda::SparseMqa p{.tokens = n,
                                .heads = H,
                                .dqk = dqk,
                                .dv = dv,
                                .q = q,
                                .kv = kv,
                                .idx = static_cast<const int32_t*>(didx) + r0 * K,
                                .len = static_cast<const int32_t*>(dlen) + r0,
                                .kslots = K,
                                .scale = pr.scale,
                                .key_rows = T,
                                .dkv_accumulate = r0 > 0};
        cuda::sparse_mqa_forward_wgmma(ctx, p, out, lse);
        // The backward reads the CPU forward's rows (as check_backward), so dq / dkv compare
        // against the CPU backward of the same values.
        DeviceArray<bf16> out_ref(rows(ob, H * dv));
        DeviceArray<float> lse_ref(H * n);
        {
            std::vector<float> lr(H * n);
            for (int64_t h = 0; h < H; ++h)
                for (int64_t t = 0; t < n; ++t) lr[h * n + t] = l[h * T + r0 + t];
            lse_ref.upload(lr);
        }
        cuda::sparse_mqa_backward_wgmma(ctx, p, out_ref, lse_ref, dout, dq, dkv);
        session.synchronize();
        const auto ov = to_float(out.download()), dqv = to_float(dq.download());
        out_all.insert(out_all.end(), ov.begin(), ov.end());
        dq_all.insert(dq_all.end(), dqv.begin(), dqv.end());
        const auto lv = lse.download();
        for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < n; ++t) lse_all[h * T + r0 + t] = lv[h * n + t];
    }
    expect_close("wgmma sparse mqa in query blocks: out", out_all, o, 1e-2);
    expect_close("wgmma sparse mqa in query blocks: lse", lse_all, l, 1e-5);
    expect_close("wgmma sparse mqa in query blocks: dq", dq_all, dqr, 1e-2);
    expect_close("wgmma sparse mqa in query blocks: dkv", dkv.download(), dkvr, 1e-2);
    expect_guard(dkv, "wgmma sparse mqa in query blocks: dkv");
}

}  // namespace

TEST(AttentionCudaGlm5Shape, ForwardMatchesCpuAtTheGlm5Shape) {
    REQUIRE_GPU();
    if (wgmma_unsupported()) GTEST_SKIP() << "the wgmma sparse MQA needs an sm_90 device";
    check_forward(1.0, 0.0);
}

TEST(AttentionCudaGlm5Shape, ForwardMatchesCpuWhenLaterChunksRaiseTheMaximum) {
    REQUIRE_GPU();
    if (wgmma_unsupported()) GTEST_SKIP() << "the wgmma sparse MQA needs an sm_90 device";
    check_forward(3.0, 0.05);
}

TEST(AttentionCudaGlm5Shape, BackwardMatchesCpuAtTheGlm5Shape) {
    REQUIRE_GPU();
    if (wgmma_unsupported()) GTEST_SKIP() << "the wgmma sparse MQA needs an sm_90 device";
    check_backward(1.0, 0.0, 0);
    check_backward(3.0, 0.05, 37);
}

TEST(AttentionCudaGlm5Shape, QueryBlocksMatchCpuOverEveryRow) {
    REQUIRE_GPU();
    if (wgmma_unsupported()) GTEST_SKIP() << "the wgmma sparse MQA needs an sm_90 device";
    check_query_blocks();
}

#endif
