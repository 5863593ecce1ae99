// The attention family on CUDA against the CPU reference: dense attention within documents, the
// sparse attention's case table walked over every form its plan supports (attention_plan.h), the
// MLA expanded-form helpers.
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
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"

#if SPARSETRON_WITH_CUDA
#include "ops/attention/sparse_attention_checks.h"
#include "ops/op_fixtures.h"
#include "sparsetron/cuda/device_caps.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(AttentionCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The attention family's CUDA tests: the shared op fixture (op_fixtures.h).
class AttentionCuda : public CudaOps {};

TEST_F(AttentionCuda, DenseAttentionForwardBackward) {
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

// The sparse attention's case table: shapes (the absorbed form's heads, latent + rope and latent
// dims, the expanded form's per-head dims), one under context parallelism (a rank's 100 query rows
// are key rows 2i + 1 of 200), and for each every form that supported_forms() gives it: the masked
// forms in one chunk and in three (the chunk offsets), with and without the forward's kept
// probabilities, each against the CPU reference (out, lse, the head-summed probabilities, dq,
// dkv or dk / dv over every key row).
struct SparseAttentionCase {
    int64_t tokens, key_rows, heads, dqk, dv, topk;
    int64_t head_qk, head_dn, head_v;  // the expanded form's (0: not run)
};
const SparseAttentionCase kSparseAttentionCases[] = {
    {200, 0, 8, 72, 64, 32, 24, 16, 16},       {200, 0, 12, 72, 64, 32, 48, 16, 32},
    {200, 0, 64, 576, 512, 96, 256, 192, 256}, {200, 0, 32, 576, 512, 96, 256, 192, 256},
    {100, 200, 12, 72, 64, 32, 0, 0, 0},
};

cuda::SparseAttentionProblem problem_of(const SparseAttentionCase& c) {
    return {.tokens = c.tokens,
            .key_rows = c.key_rows,
            .heads = c.heads,
            .dqk = c.dqk,
            .dv = c.dv,
            .topk = c.topk,
            .sm90a = cuda::has_sm90a(),
            .saved_probs_max = int64_t(1) << 40};
}

// Each row's selected keys, ascending, min(topk, its causal document keys) of them: the Docs
// documents without CP; under CP query i is key row 2i + 1 of documents [0, 120) and [120, 200).
void case_topk(const SparseAttentionCase& c, std::vector<int32_t>& idx, std::vector<int32_t>& len) {
    const int64_t T = c.tokens, K = c.topk;
    idx.assign(T * K, -1);
    len.assign(T, 0);
    const auto rb = Docs().row_begin(T);
    CounterRng rng(84, 1);
    uint64_t draw = 0;
    for (int64_t t = 0; t < T; ++t) {
        int64_t row = t, begin = rb[t];
        if (c.key_rows > 0) row = 2 * t + 1, begin = row >= 120 ? 120 : 0;
        if (begin < 0) continue;
        std::vector<int32_t> cand(size_t(row - begin + 1));
        std::iota(cand.begin(), cand.end(), int32_t(begin));
        for (size_t i = cand.size(); i > 1; --i) std::swap(cand[i - 1], cand[rng.bits(draw++) % i]);
        const int64_t n = std::min<int64_t>(K, int64_t(cand.size()));
        std::sort(cand.begin(), cand.begin() + n);
        std::copy_n(cand.begin(), n, idx.begin() + t * K);
        len[size_t(t)] = int32_t(n);
    }
}

// The absorbed forms: sparse_mqa_forward / _backward in `plan`'s form against the CPU reference.
void sparse_mqa_check(const cuda::CudaSession& session, const SparseAttentionCase& c,
                      const cuda::SparseAttentionPlan& plan, const std::string& tag) {
    const ExecContext& ctx = session.ctx();
    const int64_t T = c.tokens, H = c.heads, dqk = c.dqk, dv = c.dv, K = c.topk;
    const int64_t keys = c.key_rows > 0 ? c.key_rows : T;
    Rounded q(T * H * dqk, 81), kv(keys * dqk, 82), dout(T * H * dv, 83);
    std::vector<int32_t> idx, len;
    case_topk(c, idx, len);
    DeviceArray<int32_t> didx(idx), dlen(len);
    DeviceArray<bf16> out(T * H * dv), dq(T * H * dqk);
    DeviceArray<float> lse(H * T), dkv(keys * dqk), psum(T * K);
    DeviceArray<float> workspace(std::max<int64_t>(1, (plan.workspace_bytes + 3) / 4));
    DeviceArray<bf16> probs(std::max<int64_t>(1, plan.saved_probs_elems));
    const float scale = float(0.9 / std::sqrt(double(dqk)));
    const cuda::SparseMqa problem{T, H, dqk, dv, q.dev, kv.dev, didx, dlen, K, scale, c.key_rows};
    const cuda::SparseAttentionBuffers buffers{plan.workspace_bytes > 0 ? workspace.get() : nullptr,
                                               plan.saved_probs_elems > 0 ? probs.get() : nullptr};
    cuda::sparse_mqa_forward(ctx, plan, problem, out, lse, psum, buffers);
    cuda::sparse_mqa_backward(ctx, plan, problem, out, lse, dout.dev, dq, dkv, buffers);
    session.synchronize();
    std::vector<float> o(T * H * dv), l(H * T), dqr(T * H * dqk), ws(H * keys * dqk),
        dkvr(keys * dqk);
    cpu::sparse_mqa_forward<float>(T, H, dqk, dv, q.host.data(), kv.host.data(), idx.data(),
                                   len.data(), K, scale, o.data(), l.data());
    auto o_gpu = download_f(out);
    cpu::sparse_mqa_backward<float>(T, H, dqk, dv, q.host.data(), kv.host.data(), idx.data(),
                                    len.data(), K, scale, o_gpu.data(), l.data(), dout.host.data(),
                                    dqr.data(), ws.data(), dkvr.data(), keys);
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

// The plans a form is tested in: the masked forms with workspaces of one chunk and of three
// chunks of query rows, each with and without the kept probabilities where the form keeps them.
std::vector<cuda::SparseAttentionPlan> variants(const cuda::SparseAttentionProblem& p,
                                                cuda::SparseAttentionForm form) {
    const cuda::SparseAttentionPlan base = cuda::plan_sparse_attention(p, form);
    if (!base.masked_backward()) return {base};
    std::vector<cuda::SparseAttentionPlan> out;
    const int64_t planned = cuda::sparse_mqa_masked_workspace_bytes(p.tokens, p.heads, p.key_rows);
    for (int chunks : {1, 3}) {
        cuda::SparseAttentionPlan v = base;
        v.workspace_bytes = (p.tokens + chunks - 1) / chunks * (planned / p.tokens);
        v.saved_probs_elems = 0;
        out.push_back(v);
        if (base.masked_forward() && p.key_rows == 0) {
            v.saved_probs_elems =
                cuda::sparse_mqa_saved_probs_elems(p.tokens, p.heads, v.workspace_bytes);
            out.push_back(v);
        }
    }
    return out;
}

}  // namespace

TEST_F(AttentionCuda, SparseAttentionEveryFormOfTheCaseTableMatchesCpu) {
    for (const SparseAttentionCase& c : kSparseAttentionCases) {
        const cuda::SparseAttentionProblem p = problem_of(c);
        const std::vector<cuda::SparseAttentionForm> forms = cuda::supported_forms(p);
        // The masked forms run every row here (the keys fit); the flash ones at the GLM-5 shape on
        // sm_90a; under CP no expanded form.
        const auto has = [&](cuda::SparseAttentionForm f) {
            return std::find(forms.begin(), forms.end(), f) != forms.end();
        };
        EXPECT_TRUE(has(cuda::SparseAttentionForm::AbsorbedMasked));
        EXPECT_TRUE(has(cuda::SparseAttentionForm::AbsorbedReference));
        EXPECT_EQ(has(cuda::SparseAttentionForm::ExpandedMasked), c.key_rows == 0);
        EXPECT_EQ(has(cuda::SparseAttentionForm::AbsorbedFlash),
                  cuda::has_sm90a() && c.heads == 64 && c.dqk == 576);
        for (cuda::SparseAttentionForm form : forms)
            for (const cuda::SparseAttentionPlan& plan : variants(p, form)) {
                const std::string tag =
                    cat("sparse attention ", c.heads, " heads, qk ", c.dqk,
                        c.key_rows ? cat(", CP ", c.key_rows, " keys") : "", ": ", plan.describe());
                SCOPED_TRACE(tag);
                if (form == cuda::SparseAttentionForm::ExpandedMasked)
                    sparse_mha_check(*session_, c.heads, c.head_qk, c.head_dn, c.head_v, c.topk,
                                     plan, tag, true);
                else
                    sparse_mqa_check(*session_, c, plan, tag);
            }
    }
}

// Both kernels: head dims that are multiples of 4 (the vector kernel) and ones that are not.
TEST_F(AttentionCuda, MlaExpandedKvGradient) {
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

#endif  // SPARSETRON_WITH_CUDA
