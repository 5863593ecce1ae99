// The attention family on CUDA against the CPU reference: dense attention within documents,
// sparse MQA in its gathered and masked forms (with saved probabilities, with more key rows than
// queries), the MLA expanded-form helpers.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "../harness.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"

#if SPARSETRON_WITH_CUDA
#include "op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaOps, SkippedAttention) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

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
    const int64_t planned = cuda::sparse_mqa_masked_workspace_bytes(T, H);
    ASSERT_GT(planned, 0) << "the masked form runs at this shape";
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
        const int64_t planned = cuda::sparse_mqa_masked_workspace_bytes(Tq, H, Tk);
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
