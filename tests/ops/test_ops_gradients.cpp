// Every CPU backward against central finite differences in fp64.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "../test_util.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/loss/loss.h"
#include "sparsetron/ops/norm/norm.h"

using namespace sparsetron;
using test::random_vector;

namespace {

// Compares analytic d(loss)/d(x[i]) with (loss(x+h) - loss(x-h)) / 2h for every element of x.
void check_gradient(std::vector<double>& x, const std::vector<double>& analytic,
                    const std::function<double()>& loss, const char* what, double tol = 1e-7) {
    ASSERT_EQ(x.size(), analytic.size());
    const double h = 1e-5;
    for (size_t i = 0; i < x.size(); ++i) {
        double keep = x[i];
        x[i] = keep + h;
        double up = loss();
        x[i] = keep - h;
        double down = loss();
        x[i] = keep;
        double fd = (up - down) / (2 * h);
        double err = std::fabs(fd - analytic[i]) / std::max(1.0, std::fabs(fd));
        EXPECT_LT(err, tol) << what << "[" << i << "]: analytic " << analytic[i] << " fd " << fd;
    }
    double largest = 0;
    for (double a : analytic) largest = std::max(largest, std::fabs(a));
    EXPECT_GT(largest, 1e-6) << what << ": an all-zero gradient would make this check vacuous";
}

double weighted_sum(const std::vector<double>& y, const std::vector<double>& w) {
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
    return s;
}

}  // namespace

TEST(OpsGradients, RmsNorm) {
    const int64_t rows = 4, dim = 9, ld = 11;  // strided rows
    auto x = random_vector<double>(rows * ld, 1, 2.0), w = random_vector<double>(dim, 2);
    auto dy = random_vector<double>(rows * dim, 3);
    auto loss = [&] {
        std::vector<double> y(rows * dim), r(rows);
        cpu::rmsnorm_forward(x.data(), ld, w.data(), rows, dim, 1e-5, y.data(), dim, r.data());
        return weighted_sum(y, dy);
    };
    std::vector<double> y(rows * dim), r(rows), dx(rows * ld, 0.0), dw(dim, 0.0);
    cpu::rmsnorm_forward(x.data(), ld, w.data(), rows, dim, 1e-5, y.data(), dim, r.data());
    cpu::rmsnorm_backward(dy.data(), dim, x.data(), ld, w.data(), r.data(), rows, dim, dx.data(),
                          ld, false, dw.data());
    for (int64_t rr = 0; rr < rows; ++rr)  // the gap columns are not inputs
        for (int64_t j = dim; j < ld; ++j) x[rr * ld + j] = 0, dx[rr * ld + j] = 0;
    check_gradient(x, dx, loss, "dx");
    check_gradient(w, dw, loss, "dw");
}

TEST(OpsGradients, RopeBothPairings) {
    for (bool inter : {true, false}) {
        const int64_t T = 3, H = 2, D = 6;
        auto x = random_vector<double>(T * H * D, 4), dy = random_vector<double>(T * H * D, 5);
        std::vector<int32_t> pos = {0, 3, 9};
        auto loss = [&] {
            auto y = x;
            cpu::rope(y.data(), T, H, D, H * D, D, pos.data(), 100.0, inter, false);
            return weighted_sum(y, dy);
        };
        auto dx = dy;  // backward = inverse rotation of the incoming gradient
        cpu::rope(dx.data(), T, H, D, H * D, D, pos.data(), 100.0, inter, true);
        check_gradient(x, dx, loss, "rope");
    }
}

TEST(OpsGradients, AttentionWithDocumentsAndPadding) {
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

TEST(OpsGradients, SwiGlu) {
    const int64_t n = 12;
    auto g = random_vector<double>(n, 1, 3.0), u = random_vector<double>(n, 2),
         dy = random_vector<double>(n, 3);
    auto loss = [&] {
        std::vector<double> y(n);
        cpu::swiglu_forward(g.data(), u.data(), n, y.data());
        return weighted_sum(y, dy);
    };
    std::vector<double> dg(n), du(n);
    cpu::swiglu_backward(g.data(), u.data(), dy.data(), n, dg.data(), du.data());
    check_gradient(g, dg, loss, "dg");
    check_gradient(u, du, loss, "du");
}

TEST(OpsGradients, Embedding) {
    const int64_t V = 5, dim = 3, rows = 6;
    std::vector<int32_t> tok = {1, 4, 1, 0, 3, 1};
    auto table = random_vector<double>(V * dim, 4), dy = random_vector<double>(rows * dim, 5);
    auto loss = [&] {
        std::vector<double> y(rows * dim);
        cpu::embedding_forward(tok.data(), rows, table.data(), V, dim, y.data());
        return weighted_sum(y, dy);
    };
    std::vector<double> dt(V * dim, 0.0);
    cpu::embedding_backward(tok.data(), rows, dy.data(), V, dim, dt.data());
    check_gradient(table, dt, loss, "dtable");
}

TEST(OpsGradients, FusedHeadCrossEntropy) {
    const int64_t rows = 7, dim = 5, vocab = 9;
    auto h = random_vector<double>(rows * dim, 6, 2.0), w = random_vector<double>(vocab * dim, 7);
    std::vector<int32_t> tgt = {2, -1, 8, 0, 3, 3, -1};
    const double scale = 0.37;
    auto loss = [&] {
        std::vector<double> ws(3 * vocab);
        double l = 0;
        int64_t c = 0;
        cpu::head_cross_entropy(h.data(), rows, dim, w.data(), vocab, tgt.data(), 3, ws.data(), 0.0,
                                (double*)nullptr, (double*)nullptr, &l, &c);
        return scale * l;
    };
    std::vector<double> ws(3 * vocab), dh(rows * dim), dw(vocab * dim, 0.0);
    double l = 0;
    int64_t c = 0;
    cpu::head_cross_entropy(h.data(), rows, dim, w.data(), vocab, tgt.data(), 3, ws.data(), scale,
                            dh.data(), dw.data(), &l, &c);
    check_gradient(h, dh, loss, "dh");
    check_gradient(w, dw, loss, "dw");
}
