// The attention family's CPU references (ops/attention/attention.h): dense causal attention within
// documents against a naive fp64 form, its backward by finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/fd_check.h"
#include "sparsetron/ops/attention/attention.h"
#include "test_util.h"

using namespace sparsetron;
using test::check_gradient;
using test::max_rel_error;
using test::random_vector;
using test::weighted_sum;

namespace {
// Naive attention: per document, causal softmax in fp64.
std::vector<double> naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v, const std::vector<int32_t>& cu,
                                    int64_t T, int64_t H, int64_t D, int64_t Dv, double scale) {
    std::vector<double> out(T * H * Dv, 0.0);
    for (size_t d = 0; d + 1 < cu.size(); ++d)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
                std::vector<double> s;
                double mx = -1e300, sum = 0;
                for (int64_t j = cu[d]; j <= i; ++j) {
                    double dot = 0;
                    for (int64_t c = 0; c < D; ++c)
                        dot += q[(i * H + h) * D + c] * k[(j * H + h) * D + c];
                    s.push_back(dot * scale);
                    mx = std::max(mx, dot * scale);
                }
                for (double& x : s) sum += (x = std::exp(x - mx));
                for (int64_t j = cu[d]; j <= i; ++j)
                    for (int64_t c = 0; c < Dv; ++c)
                        out[(i * H + h) * Dv + c] += s[j - cu[d]] / sum * v[(j * H + h) * Dv + c];
            }
    return out;
}
}  // namespace

TEST(Attention, AttentionMasksCausallyWithinDocuments) {
    const int64_t T = 13, H = 2, D = 6, Dv = 5;
    std::vector<int32_t> cu = {0, 4, 5, 11};  // three documents, two padding rows at the end
    auto q = random_vector<double>(T * H * D, 1, 2.0), k = random_vector<double>(T * H * D, 2, 2.0);
    auto v = random_vector<double>(T * H * Dv, 3);
    std::vector<double> out(T * H * Dv), lse(H * T);
    cpu::AttnShape s{T, H, D, Dv, H * D, D, H * D, D, H * Dv, Dv};
    cpu::attention_forward(s, q.data(), k.data(), v.data(), cu.data(), 3, 0.3, out.data(),
                           lse.data());
    EXPECT_LT(max_rel_error(out, naive_attention(q, k, v, cu, T, H, D, Dv, 0.3)), 1e-13);
    // Changing a key of document 2 leaves documents 0 and 1 untouched.
    k[(6 * H + 1) * D + 2] += 5.0;
    std::vector<double> out2(T * H * Dv);
    cpu::attention_forward(s, q.data(), k.data(), v.data(), cu.data(), 3, 0.3, out2.data(),
                           lse.data());
    for (int64_t i = 0; i < 5 * H * Dv; ++i) EXPECT_EQ(out[i], out2[i]);
    for (int64_t i = 11 * H * Dv; i < T * H * Dv; ++i) EXPECT_EQ(out2[i], 0.0);  // padding
}

TEST(Attention, GradientAttentionWithDocumentsAndPadding) {
    const int64_t T = 9, H = 2, D = 4, Dv = 3;
    std::vector<int32_t> cu = {0, 3, 8};
    auto q = random_vector<double>(T * H * D, 6, 1.5), k = random_vector<double>(T * H * D, 7, 1.5);
    // v as a strided view inside a wider buffer (as MLA reads it from kv).
    const int64_t vst = H * (Dv + 2), vsh = Dv + 2;
    auto vbuf = random_vector<double>(T * vst, 8);
    auto dout = random_vector<double>(T * H * Dv, 9);
    cpu::AttnShape s{T, H, D, Dv, H * D, D, H * D, D, vst, vsh};
    auto loss = [&] {
        std::vector<double> out(T * H * Dv), lse(H * T);
        cpu::attention_forward(s, q.data(), k.data(), vbuf.data() + 1, cu.data(), 2, 0.4,
                               out.data(), lse.data());
        return weighted_sum(out, dout);
    };
    std::vector<double> out(T * H * Dv), lse(H * T), dq(T * H * D), dk(T * H * D), dv(T * vst, 0.0);
    cpu::attention_forward(s, q.data(), k.data(), vbuf.data() + 1, cu.data(), 2, 0.4, out.data(),
                           lse.data());
    cpu::attention_backward(s, q.data(), k.data(), vbuf.data() + 1, out.data(), lse.data(),
                            dout.data(), cu.data(), 2, 0.4, dq.data(), dk.data(), dv.data() + 1);
    check_gradient(q, dq, loss, "dq");
    check_gradient(k, dk, loss, "dk");
    check_gradient(vbuf, dv, loss, "dv");
}
