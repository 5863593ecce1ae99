// The indexer's CPU references (ops/indexer/indexer.h): the scores of a row against their formula,
// the top-k rule's order and ties, and the KL loss of a row (its value and its gradient with
// respect to the scores, by finite differences, with the sparse and the dense teacher).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/fd_check.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "test_util.h"

using namespace sparsetron;
using test::check_gradient;
using test::random_vector;

TEST(Indexer, ScoresRowIsTheWeightedSumOfReluDots) {
    const int64_t H = 3, d = 5, keys = 7, begin = 2, last = 5;
    auto q = random_vector<double>(H * d, 51), w = random_vector<double>(H, 52);
    auto k = random_vector<double>(keys * d, 53);
    std::vector<double> out(keys, -99.0);
    cpu::indexer_scores_row(q.data(), w.data(), k.data(), H, d, begin, last, out.data());
    int positive = 0, negative = 0;
    for (int64_t s = 0; s < keys; ++s) {
        if (s < begin || s > last) {
            EXPECT_EQ(out[s], -99.0) << "key " << s << " is outside [begin, last]";
            continue;
        }
        double want = 0;
        for (int64_t j = 0; j < H; ++j) {
            double dot = 0;
            for (int64_t i = 0; i < d; ++i) dot += q[j * d + i] * k[s * d + i];
            (dot > 0 ? positive : negative) += 1;
            want += w[j] * std::max(dot, 0.0);
        }
        EXPECT_NEAR(out[s], want, 1e-14) << "key " << s;
    }
    EXPECT_GT(positive, 0);
    EXPECT_GT(negative, 0) << "the ReLU must cut some heads";
}

// The k largest, ties toward the smaller key index, written ascending; fewer keys than k: all.
TEST(Indexer, TopkRowTakesTheLargestAndBreaksTiesTowardTheSmallerKey) {
    const std::vector<float> row = {9, 1, 5, 7, 5, 5, 2, 7, 0};
    std::vector<int32_t> idx(8, -1), order;
    // Keys 1..8: the four largest are 7 (keys 3, 7) and 5 (keys 2, 4, 5): ties keep 2 and 4.
    EXPECT_EQ(cpu::topk_row(row.data(), 1, 8, 4, idx.data(), order), 4);
    EXPECT_EQ(std::vector<int32_t>(idx.begin(), idx.begin() + 4),
              (std::vector<int32_t>{2, 3, 4, 7}));
    EXPECT_EQ(idx[4], -1) << "nothing written past the count";
    // Three keys, k = 8: all of them, ascending.
    EXPECT_EQ(cpu::topk_row(row.data(), 6, 8, 8, idx.data(), order), 3);
    EXPECT_EQ(std::vector<int32_t>(idx.begin(), idx.begin() + 3), (std::vector<int32_t>{6, 7, 8}));
}

namespace {
// A teacher over `keys` latent rows for `tokens` query rows of `heads` heads.
struct TeacherData {
    int64_t tokens = 2, heads = 3, dim = 4, keys = 6;
    std::vector<double> q = random_vector<double>(size_t(tokens * heads * dim), 61);
    std::vector<double> k = random_vector<double>(size_t(keys * dim), 62);
    std::vector<double> lse = std::vector<double>(size_t(heads * tokens), 0.0);
    double scale = 0.7;
    cpu::IndexerTeacher<double> teacher() const {
        return {q.data(), k.data(), lse.data(), heads, dim, scale, tokens};
    }
};
}  // namespace

// The KL loss of row t against its teacher (the dense teacher: softmax over the support per head,
// summed and normalized) and its gradient with respect to the scores: target = q - p on the
// support, matching finite differences; nothing written off the support.
TEST(Indexer, KlRowValueAndGradientWithTheDenseTeacher) {
    TeacherData td;
    const int64_t t = 1;
    const std::vector<int32_t> support = {0, 2, 3, 5};
    const int64_t n = int64_t(support.size());
    auto scores = random_vector<double>(size_t(td.keys), 63, 2.0);
    std::vector<double> target(size_t(td.keys), -5.0), p;
    const double kl = cpu::indexer_kl_row(td.teacher(), t, false, support.data(), n, scores.data(),
                                          target.data(), p);
    // The teacher by its definition.
    std::vector<double> teacher(static_cast<size_t>(n), 0.0);
    for (int64_t h = 0; h < td.heads; ++h) {
        std::vector<double> z(static_cast<size_t>(n));
        double norm = 0;
        for (int64_t j = 0; j < n; ++j) {
            double dot = 0;
            for (int64_t i = 0; i < td.dim; ++i)
                dot += td.q[(t * td.heads + h) * td.dim + i] * td.k[support[j] * td.dim + i];
            z[j] = std::exp(dot * td.scale);
            norm += z[j];
        }
        for (int64_t j = 0; j < n; ++j) teacher[j] += z[j] / norm / double(td.heads);
    }
    auto kl_of = [&](const std::vector<double>& s) {
        double norm = 0, value = 0;
        for (int32_t key : support) norm += std::exp(s[key]);
        for (int64_t j = 0; j < n; ++j)
            value += teacher[j] * (std::log(teacher[j]) - (s[support[j]] - std::log(norm)));
        return value;
    };
    EXPECT_NEAR(kl, kl_of(scores), 1e-13);
    EXPECT_GT(kl, 1e-3);
    std::vector<double> x(static_cast<size_t>(n)), analytic(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) x[j] = scores[support[j]], analytic[j] = target[support[j]];
    check_gradient(
        x, analytic,
        [&] {
            std::vector<double> s = scores;
            for (int64_t j = 0; j < n; ++j) s[support[j]] = x[j];
            return kl_of(s);
        },
        "dKL/dscores");
    for (int64_t key : {1, 4}) EXPECT_EQ(target[key], -5.0) << "key " << key << " is off support";
}

// The sparse teacher reads the attention's LSE instead of recomputing it: with the LSE over the
// same support it gives the dense teacher's loss; with another LSE the teacher's unnormalized
// weights change and so does the loss.
TEST(Indexer, KlRowSparseTeacherReadsTheAttentionLse) {
    TeacherData td;
    const int64_t t = 0;
    const std::vector<int32_t> support = {1, 2, 4};
    auto scores = random_vector<double>(size_t(td.keys), 64, 2.0);
    std::vector<double> target(size_t(td.keys)), p;
    const double dense = cpu::indexer_kl_row(td.teacher(), t, false, support.data(), 3,
                                             scores.data(), target.data(), p);
    for (int64_t h = 0; h < td.heads; ++h) {
        double norm = 0;
        for (int32_t key : support) {
            double dot = 0;
            for (int64_t i = 0; i < td.dim; ++i)
                dot += td.q[(t * td.heads + h) * td.dim + i] * td.k[key * td.dim + i];
            norm += std::exp(dot * td.scale);
        }
        td.lse[h * td.tokens + t] = std::log(norm);
    }
    EXPECT_NEAR(cpu::indexer_kl_row(td.teacher(), t, true, support.data(), 3, scores.data(),
                                    target.data(), p),
                dense, 1e-13);
    td.lse[0 * td.tokens + t] += 1.0;  // head 0's weights shrink by e: the teacher changes
    EXPECT_GT(std::fabs(cpu::indexer_kl_row(td.teacher(), t, true, support.data(), 3, scores.data(),
                                            target.data(), p) -
                        dense),
              1e-6);
}
