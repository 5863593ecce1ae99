// The DSA sparse attention in MLA's expanded form (per-head keys and values, masked dense GEMMs
// batched over the heads: sparse_mha_forward_masked / sparse_mha_backward_masked) against the
// CPU's absorbed-form reference, label gpu. Head h of the expanded form is one-head sparse MQA
// over kv'[s] = [V_h[s] ; K_h[s]] with q'[t] = [0 ; Q_h[t]]: the scores are Q_h K_h^T, the
// values V_h, and the reference's dkv' splits into dV_h (first dv columns: q' is 0 there, so no
// key gradient lands in them) and dK_h. Keys and values sit in the model's strided layout (K in
// [T, H, dqk], V at column dn of [T, H, dn + dv]). Tolerances as test_attention_cuda.cpp's sparse
// MQA checks; dq / dk / dv start as NaN: the backward must overwrite them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "gpu/harness.h"
#include "ops/attention/sparse_attention_checks.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"
#if SPARSETRON_WITH_CUDA
#include "gpu/cuda_session_test.h"
#include "sparsetron/cuda/cuda_session.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(AttentionCudaHeads, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op harness runs on the GPU machine";
}
#else

class AttentionCudaHeads : public CudaSessionTest {};

namespace {

constexpr int64_t kRows = 200;

// Documents [0, 120) and [120, 190), then padding rows (no keys); each row selects an ascending
// random subset of min(K, its causal document keys).
void random_topk(int64_t K, std::vector<int32_t>& idx, std::vector<int32_t>& len) {
    idx.assign(kRows * K, -1);
    len.assign(kRows, 0);
    CounterRng rng(91, 1);
    uint64_t draw = 0;
    for (int64_t t = 0; t < 190; ++t) {
        const int64_t begin = t < 120 ? 0 : 120;
        std::vector<int32_t> cand(t - begin + 1);
        std::iota(cand.begin(), cand.end(), int32_t(begin));
        for (size_t i = cand.size(); i > 1; --i) std::swap(cand[i - 1], cand[rng.bits(draw++) % i]);
        const int64_t n = std::min<int64_t>(K, int64_t(cand.size()));
        std::sort(cand.begin(), cand.begin() + n);
        std::copy_n(cand.begin(), n, idx.begin() + t * K);
        len[t] = int32_t(n);
    }
}

}  // namespace

void test::sparse_mha_check(const cuda::CudaSession& session, int64_t H, int64_t dqk, int64_t dn,
                            int64_t dv, int64_t K, const cuda::SparseAttentionPlan& plan,
                            const std::string& tag, bool head_sums) {
    const ExecContext& ctx = session.ctx();
    std::vector<int32_t> idx, len;
    random_topk(K, idx, len);
    const int64_t wv = dn + dv;  // the kv_b output's per-head width
    // Host copies rounded to bf16 in place by to_bf16_rounding: the reference sees the device's
    // values.
    auto qh = random_vector<float>(kRows * H * dqk, 92),
         kh = random_vector<float>(kRows * H * dqk, 93);
    auto vh = random_vector<float>(kRows * H * wv, 94),
         doh = random_vector<float>(kRows * H * dv, 95);
    DeviceArray<bf16> q(to_bf16_rounding(qh)), k(to_bf16_rounding(kh)), v(to_bf16_rounding(vh));
    DeviceArray<bf16> dout(to_bf16_rounding(doh)), out(kRows * H * dv);
    DeviceArray<int32_t> didx(idx), dlen(len);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> nans(kRows * H * dqk, nan);
    DeviceArray<bf16> dq(to_bf16_rounding(nans));
    DeviceArray<float> lse(H * kRows), psum(kRows * K);
    DeviceArray<float> dk(std::vector<float>(kRows * H * dqk, nan));
    DeviceArray<float> dvv(std::vector<float>(kRows * H * dv, nan));
    ASSERT_EQ(plan.form, cuda::SparseAttentionForm::ExpandedMasked) << tag;
    DeviceArray<float> workspace((plan.workspace_bytes + 3) / 4);
    DeviceArray<bf16> probs(std::max<int64_t>(1, plan.saved_probs_elems));
    const cuda::SparseAttentionBuffers buffers{workspace.get(), probs.get()};
    const cuda::HeadKV kv{k, H * dqk, dqk, static_cast<const bf16*>(v) + dn, H * wv, wv};
    const float scale = float(0.9 / std::sqrt(double(dqk)));
    const cuda::SparseMha problem{kRows, H, dqk, dv, q, kv, didx, dlen, K, scale};
    cuda::sparse_mha_forward(ctx, plan, problem, out, lse,
                             head_sums ? static_cast<float*>(psum) : nullptr, buffers);
    cuda::sparse_mha_backward(ctx, plan, problem, out, lse, dout, dq, dk, dvv, buffers);
    session.synchronize();
    const auto o_gpu = to_float(out.download());

    // The reference, head by head, as one-head sparse MQA over [V_h ; K_h].
    const int64_t L = dv + dqk;
    std::vector<float> o(kRows * H * dv), l(H * kRows), dqr(kRows * H * dqk), dkr(kRows * H * dqk),
        dvr(kRows * H * dv);
    std::vector<double> prob_sum(kRows * K, 0.0);
    std::vector<float> qp(kRows * L), kvp(kRows * L), oh(kRows * dv), lh(kRows), goh(kRows * dv),
        oh_gpu(kRows * dv), dqp(kRows * L), ws(kRows * L), dkvp(kRows * L);
    for (int64_t h = 0; h < H; ++h) {
        for (int64_t t = 0; t < kRows; ++t) {
            for (int64_t c = 0; c < dv; ++c) {
                qp[t * L + c] = 0.f;
                kvp[t * L + c] = vh[(t * H + h) * wv + dn + c];
                goh[t * dv + c] = doh[(t * H + h) * dv + c];
                oh_gpu[t * dv + c] = o_gpu[(t * H + h) * dv + c];
            }
            for (int64_t c = 0; c < dqk; ++c) {
                qp[t * L + dv + c] = qh[(t * H + h) * dqk + c];
                kvp[t * L + dv + c] = kh[(t * H + h) * dqk + c];
            }
        }
        cpu::sparse_mqa_forward<float>(kRows, 1, L, dv, qp.data(), kvp.data(), idx.data(),
                                       len.data(), K, scale, oh.data(), lh.data());
        cpu::sparse_mqa_backward<float>(kRows, 1, L, dv, qp.data(), kvp.data(), idx.data(),
                                        len.data(), K, scale, oh_gpu.data(), lh.data(), goh.data(),
                                        dqp.data(), ws.data(), dkvp.data());
        for (int64_t t = 0; t < kRows; ++t) {
            l[h * kRows + t] = lh[t];
            for (int64_t c = 0; c < dv; ++c) {
                o[(t * H + h) * dv + c] = oh[t * dv + c];
                dvr[(t * H + h) * dv + c] = dkvp[t * L + c];
            }
            for (int64_t c = 0; c < dqk; ++c) {
                dqr[(t * H + h) * dqk + c] = dqp[t * L + dv + c];
                dkr[(t * H + h) * dqk + c] = dkvp[t * L + dv + c];
            }
            for (int64_t j = 0; j < len[t]; ++j) {
                const int64_t s = idx[t * K + j];
                double d = 0;
                for (int64_t c = 0; c < L; ++c) d += double(qp[t * L + c]) * kvp[s * L + c];
                prob_sum[t * K + j] += std::exp(d * scale - lh[t]);
            }
        }
    }
    expect_close(tag + " out", o_gpu, o, 1e-2);
    expect_close(tag + " lse", lse.download(), l, 1e-5);
    if (head_sums)
        expect_close(tag + " head probability sums", psum.download(),
                     std::vector<float>(prob_sum.begin(), prob_sum.end()), 1e-4);
    expect_close(tag + " dq", to_float(dq.download()), dqr, 1e-2);
    expect_close(tag + " dk", dk.download(), dkr, 1e-2);
    expect_close(tag + " dv", dvv.download(), dvr, 1e-2);
    expect_guard(out, tag + " out");
    expect_guard(dk, tag + " dk");
}

namespace {

// The expanded form's plan for kRows rows of H heads with a workspace of `chunks` chunks, the
// forward's probabilities kept or not.
cuda::SparseAttentionPlan expanded_plan(int64_t H, int chunks, bool saved) {
    const int64_t planned = cuda::sparse_mqa_masked_workspace_bytes(kRows, H);
    EXPECT_GT(planned, 0) << "the masked form runs at this shape";
    cuda::SparseAttentionPlan plan;
    plan.form = cuda::SparseAttentionForm::ExpandedMasked;
    plan.workspace_bytes = (kRows + chunks - 1) / chunks * (planned / kRows);
    plan.saved_probs_elems =
        saved ? cuda::sparse_mqa_saved_probs_elems(kRows, H, plan.workspace_bytes) : 0;
    plan.query_block_rows = kRows;
    return plan;
}

void check(const cuda::CudaSession& session, int64_t H, int64_t dqk, int64_t dn, int64_t dv,
           int64_t K, int chunks, bool saved, const std::string& tag, bool head_sums = true) {
    sparse_mha_check(session, H, dqk, dn, dv, K, expanded_plan(H, chunks, saved), tag, head_sums);
}

}  // namespace

// 12 heads: the backward's second group of 8 heads is partial; 1 and 3 chunks (the backward's
// last chunk writes dK / dV, the others add).
TEST_F(AttentionCudaHeads, SmallHeads) {
    check(*session_, 12, 48, 16, 32, 32, 1, false, "sparse mha (masked, one chunk)");
    check(*session_, 12, 48, 16, 32, 32, 3, false, "sparse mha (masked, 3 chunks)");
    check(*session_, 12, 48, 16, 32, 32, 3, true, "sparse mha (masked, saved P, 3 chunks)");
}

// The GLM-5 shape: 64 heads, qk 192 + 64, v 256 (kv_b's per-head width 448).
TEST_F(AttentionCudaHeads, Glm5Shape) {
    check(*session_, 64, 256, 192, 256, 96, 2, false, "sparse mha (masked, GLM-5 shape)");
    check(*session_, 64, 256, 192, 256, 96, 2, true, "sparse mha (masked, saved P, GLM-5 shape)");
    // Without the head sums: P and the lse from masked_probs_wgmma on sm_90 (3 chunks: a chunk
    // of 67 rows, two 64-row blocks with a partial one; tiles past a block's last token zeroed).
    check(*session_, 64, 256, 192, 256, 96, 3, true,
          "sparse mha (masked, saved P, no head sums, GLM-5 shape)", false);
    check(*session_, 64, 256, 192, 256, 96, 2, false,
          "sparse mha (masked, no head sums, GLM-5 shape)", false);
}

#endif
