// The MoE family's CPU references (ops/moe): the router and the permutation, the sequence aux
// loss, the paged stash, and the stash pool's bound (model/moe_stash_bound.h). The CUDA kernels are
// compared with these in tests/gpu/ops/test_moe_cuda.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/model/moe_stash_bound.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/ops/moe/paged_stash.h"
#include "sparsetron/ops/moe/sequence_aux.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

// Three row-major tensors of `rows` rows (widths 3, 2, 5) filled with distinct values.
struct Tensors {
    std::vector<bf16> a, b, c;
    Tensors(int64_t rows, int seed) : a(rows * 3), b(rows * 2), c(rows * 5) {
        int v = seed * 1000;
        for (auto* t : {&a, &b, &c})
            for (auto& x : *t) x = float_to_bf16(float(v++ % 4096));
    }
    StashRows rows() {
        StashRows s;
        s.count = 3;
        s.data[0] = a.data(), s.width[0] = 3;
        s.data[1] = b.data(), s.width[1] = 2;
        s.data[2] = c.data(), s.width[2] = 5;
        return s;
    }
};

bool same(const std::vector<bf16>& x, const std::vector<bf16>& y, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (x[i].bits != y[i].bits) return false;
    return true;
}

}  // namespace

// Two pushes fit, a third overflows; pops in reverse order give back every row and leave the free
// list as it started.
TEST(PagedStash, PushPopOverflowAndFreeList) {
    const int64_t pages = 10, page_rows = 4, width = 10, max_rows = 16;
    std::vector<int32_t> state(kStashStateWords, 7), free_list(pages, -5);
    std::vector<bf16> pool(pages * page_rows * width);
    cpu::stash_reset(state.data(), free_list.data(), pages, true);
    EXPECT_EQ(state, (std::vector<int32_t>{10, 0, 0, 0, 0}));
    const int32_t rows_a = 9, rows_b = 13, rows_c = 14;  // 3, 4 and 4 pages
    Tensors a(max_rows, 1), b(max_rows, 2), c(max_rows, 3);
    std::vector<int32_t> ta(1 + 4, -9), tb(1 + 4, -9), tc(1 + 4, -9);
    cpu::stash_push(state.data(), free_list.data(), pages, ta.data(), max_rows, &rows_a, page_rows,
                    a.rows(), pool.data());
    cpu::stash_push(state.data(), free_list.data(), pages, tb.data(), max_rows, &rows_b, page_rows,
                    b.rows(), pool.data());
    EXPECT_EQ(ta[0], 3);
    EXPECT_EQ(tb[0], 4);
    std::set<int32_t> used(ta.begin() + 1, ta.begin() + 4);
    used.insert(tb.begin() + 1, tb.end());
    EXPECT_EQ(used.size(), 7u) << "a page was given to two pushes";
    EXPECT_EQ(state[0], 3);  // free
    EXPECT_EQ(state[1], 7);  // peak in use
    EXPECT_EQ(state[2], 0);
    // Row 5 of push a is row 1 of its second page, segment by segment.
    const bf16* row = pool.data() + (int64_t(ta[2]) * page_rows + 1) * width;
    EXPECT_EQ(row[0].bits, a.a[5 * 3].bits);
    EXPECT_EQ(row[3].bits, a.b[5 * 2].bits);
    EXPECT_EQ(row[9].bits, a.c[5 * 5 + 4].bits);
    cpu::stash_push(state.data(), free_list.data(), pages, tc.data(), max_rows, &rows_c, page_rows,
                    c.rows(), pool.data());
    EXPECT_EQ(tc[0], -4);
    EXPECT_EQ(state[0], 3) << "an overflowed push took pages";
    EXPECT_EQ(state[2], 1);
    EXPECT_EQ(state[3], 11);  // what the pool would have needed
    EXPECT_EQ(state[4], 11);
    // Pop in reverse: c gives back nothing, b and a get their rows back.
    Tensors back(max_rows, 9);
    cpu::stash_pop(state.data(), free_list.data(), tc.data(), &rows_c, page_rows, back.rows(),
                   pool.data());
    EXPECT_EQ(state[0], 3);
    EXPECT_EQ(state[4], 7);
    cpu::stash_pop(state.data(), free_list.data(), tb.data(), &rows_b, page_rows, back.rows(),
                   pool.data());
    EXPECT_TRUE(same(back.a, b.a, rows_b * 3) && same(back.b, b.b, rows_b * 2) &&
                same(back.c, b.c, rows_b * 5));
    EXPECT_FALSE(same(back.a, b.a, max_rows * 3)) << "rows past the push were written";
    cpu::stash_pop(state.data(), free_list.data(), ta.data(), &rows_a, page_rows, back.rows(),
                   pool.data());
    EXPECT_TRUE(same(back.a, a.a, rows_a * 3) && same(back.c, a.c, rows_a * 5));
    std::vector<int32_t> start(pages);
    std::iota(start.begin(), start.end(), 0);
    EXPECT_EQ(free_list, start);
    EXPECT_EQ(state, (std::vector<int32_t>{10, 7, 1, 11, 0}));
    // A micro-batch reset keeps the step's statistics; a new step clears them.
    cpu::stash_reset(state.data(), free_list.data(), pages, false);
    EXPECT_EQ(state, (std::vector<int32_t>{10, 7, 1, 11, 0}));
    cpu::stash_reset(state.data(), free_list.data(), pages, true);
    EXPECT_EQ(state, (std::vector<int32_t>{10, 0, 0, 0, 0}));
}

TEST(PagedStash, EmptyPushAndRowsOverTheTableBound) {
    const int64_t pages = 8, page_rows = 4, max_rows = 8;
    std::vector<int32_t> state(kStashStateWords), free_list(pages), table(1 + 2, -9);
    std::vector<bf16> pool(pages * page_rows * 10);
    Tensors t(12, 4);
    cpu::stash_reset(state.data(), free_list.data(), pages, true);
    const int32_t zero = 0, too_many = 9;
    cpu::stash_push(state.data(), free_list.data(), pages, table.data(), max_rows, &zero, page_rows,
                    t.rows(), pool.data());
    EXPECT_EQ(table[0], 0);
    EXPECT_EQ(state[0], 8);
    cpu::stash_pop(state.data(), free_list.data(), table.data(), &zero, page_rows, t.rows(),
                   pool.data());
    // 9 rows need 3 pages and 8 are free, but the table was sized for 8 rows: an overflow.
    cpu::stash_push(state.data(), free_list.data(), pages, table.data(), max_rows, &too_many,
                    page_rows, t.rows(), pool.data());
    EXPECT_EQ(table[0], -3);
    EXPECT_EQ(state[2], 1);
    EXPECT_EQ(state[0], 8);
}

TEST(PagedStash, PoolBoundFollowsTheRecipe) {
    Recipe r = load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml");
    ModelConfig c = r.model;
    // 2 MoE layers + 7 MTP depths of the (MoE) MTP layer; 4096 tokens x top-8 rows each.
    MoeStashBound b = moe_stash_bound(c, 4096);
    EXPECT_EQ(b.applications, 9);
    EXPECT_EQ(b.max_rows, 32768);
    EXPECT_EQ(b.pages_per_application, 512);
    EXPECT_EQ(b.balanced_pages, 9 * 512);
    EXPECT_EQ(b.pool_pages, 5069);  // Megatron's default factor 1.10: ceil(1.1 x 4608)
    c.moe_paged_stash_buffer_size_factor_cuda = 0.55;
    EXPECT_EQ(moe_stash_bound(c, 4096).pool_pages, 2535);  // ceil(0.55 x 4608)
    // Expert parallelism over 4 ranks: a page table holds what the rank's 4 experts can receive
    // (4 sources x 4 experts x 4096 rows), the pool is sized from what balanced routing keeps
    // (the 4096 x 8 rows the rank sent).
    ModelConfig ep = c;
    ep.expert_parallel_ranks = 4;
    const MoeStashBound e = moe_stash_bound(ep, 4096);
    EXPECT_EQ(e.max_rows, 4 * 4 * 4096);
    EXPECT_EQ(e.balanced_rows, 4096 * 8);
    EXPECT_EQ(e.balanced_pages, 9 * 512);
    EXPECT_EQ(e.pool_pages, 2535);
    // Pipeline stages: each counts its own MoE layers, the last one the MTP depths too; the
    // stages' applications add up to the model's.
    const int64_t half = c.num_layers / 2;
    int64_t first_half = 0;
    for (int64_t l = 0; l < half; ++l) first_half += c.is_moe_layer(l);
    const MoeStashBound s0 = moe_stash_bound(c, 4096, {PipelineStage{0, 2, 0, half}});
    const MoeStashBound s1 = moe_stash_bound(c, 4096, {PipelineStage{1, 2, half, -1}});
    EXPECT_EQ(s0.applications, first_half);
    EXPECT_EQ(s1.applications, 9 - first_half);
    EXPECT_GE(s1.applications, 7) << "the MTP depths are the last stage's";
    EXPECT_EQ(s1.pool_pages, int64_t(std::ceil(0.55 * double(s1.applications * 512))));
    // Interleaved stages: a rank's chunks add theirs (pipeline rank 1 of 2 holds stages 1 and 3
    // of 4, the last with the MTP depths).
    EXPECT_EQ(moe_stash_bound(c, 4096, {PipelineStage{0, 4, 0, 1}, PipelineStage{2, 4, 2, 3}})
                  .applications,
              1);  // layer 2
    EXPECT_EQ(moe_stash_bound(c, 4096, {PipelineStage{1, 4, 1, 2}, PipelineStage{3, 4, 3, -1}})
                  .applications,
              1 + 7);  // layer 3 and the MTP depths
    c.moe_paged_stash_page_size = 100;
    EXPECT_EQ(moe_stash_bound(c, 4096).pages_per_application, 328);
    // A capacity factor below top-k / experts caps the kept rows: 16 experts x 1024.
    c.moe_capacity_factor = 0.5;
    EXPECT_EQ(moe_stash_bound(c, 4096).max_rows, 16 * 1024);
    // The MTP layer repeats the last backbone layer's kind: all-dense backbones stash nothing.
    c.moe_layer_freq = "[0,0,0,0]";
    c.moe_layer_pattern = {0, 0, 0, 0};
    EXPECT_EQ(moe_stash_bound(c, 4096).applications, 0);
}

// The router: sigmoid probabilities for every row; for the routed rows the top-k of probs + bias
// (ties toward the smaller expert) and gates scaled to sum to `scaling`; rows past `routed` get
// probabilities only.
TEST(MoeRouter, TopkOfBiasedProbabilitiesAndScaledGates) {
    const int64_t T = 5, routed = 4, E = 6, k = 2;
    auto logits = test::random_vector<double>(T * E, 71, 2.0);
    std::vector<double> bias = {0.0, 0.3, 0.0, -0.2, 0.1, 0.0};
    for (int64_t e = 0; e < E; ++e) logits[e] = -3.0;
    logits[0 * E + 2] = logits[0 * E + 5] = 3.0;  // row 0: experts 2 and 5 tie at the top
    std::vector<double> probs(T * E), gates(T * k, -1.0);
    std::vector<int32_t> topk(T * k, -7);
    cpu::router_topk(logits.data(), bias.data(), T, routed, E, k, false, 2.5, probs.data(),
                     topk.data(), gates.data());
    for (int64_t i = 0; i < T * E; ++i)
        EXPECT_NEAR(probs[i], 1 / (1 + std::exp(-logits[i])), 1e-15);
    for (int64_t t = 0; t < routed; ++t) {
        std::vector<int32_t> order(E);
        for (int32_t e = 0; e < E; ++e) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return probs[t * E + a] + bias[a] > probs[t * E + b] + bias[b];
        });
        EXPECT_EQ(topk[t * k], order[0]) << "row " << t;
        EXPECT_EQ(topk[t * k + 1], order[1]) << "row " << t;
        EXPECT_NEAR(gates[t * k] + gates[t * k + 1], 2.5, 1e-12);
        EXPECT_NEAR(gates[t * k] / gates[t * k + 1],
                    probs[t * E + topk[t * k]] / probs[t * E + topk[t * k + 1]], 1e-12);
    }
    EXPECT_EQ(topk[0], 2) << "a tie goes to the smaller expert";
    EXPECT_EQ(topk[(T - 1) * k], -7) << "rows past `routed` are not routed";
    // Forced balance: row t takes experts (t k + j) mod E.
    cpu::router_topk(logits.data(), bias.data(), T, routed, E, k, true, 1.0, probs.data(),
                     topk.data(), gates.data());
    for (int64_t t = 0; t < routed; ++t)
        for (int64_t j = 0; j < k; ++j) EXPECT_EQ(topk[t * k + j], (t * k + j) % E);
}

// The permutation: expert-major rows, token order within an expert, at most `capacity` rows per
// expert (the rest dropped: slot -1), counts before the capacity.
TEST(MoeRouter, PermutationIsExpertMajorAndCapacityBounded) {
    const int64_t tokens = 5, routed = 4, E = 3, k = 2, capacity = 2;
    const std::vector<int32_t> topk = {0, 2, 2, 1, 2, 0, 2, 1, 9, 9};  // row 4 is not routed
    std::vector<int64_t> counts(E), offsets(E + 1);
    std::vector<int32_t> slot_row(tokens * k, 7), perm(tokens * k, -1);
    cpu::moe_permute(topk.data(), routed, tokens, E, k, capacity, counts.data(), offsets.data(),
                     slot_row.data(), perm.data());
    EXPECT_EQ(counts, (std::vector<int64_t>{2, 2, 4}));
    EXPECT_EQ(offsets, (std::vector<int64_t>{0, 2, 4, 6}));
    // Expert 2's choices come from tokens 0, 1, 2, 3 in order: the last two are dropped.
    EXPECT_EQ(slot_row, (std::vector<int32_t>{0, 4, 5, 2, -1, 1, -1, 3, -1, -1}));
    EXPECT_EQ(std::vector<int32_t>(perm.begin(), perm.begin() + 6),
              (std::vector<int32_t>{0, 2, 1, 3, 0, 1}));
}

// The sequence aux loss's statistics per document, counted directly, and its logit gradient
// against central differences of Σ_d w_d Σ_e f_de psum_de (f fixed: it counts choices).
TEST(MoeSequenceAux, DocumentStatisticsAndLogitGradient) {
    const int64_t T = 23, E = 5, k = 2, D = 4;
    const std::vector<int32_t> doc_rows = {0, 6, 6, 14, 20};  // an empty document, 3 padding rows
    auto logits = test::random_vector<double>(T * E, 81, 2.0);
    const auto sigmoid = [](const std::vector<double>& l) {
        std::vector<double> s(l.size());
        for (size_t i = 0; i < l.size(); ++i) s[i] = 1 / (1 + std::exp(-l[i]));
        return s;
    };
    std::vector<double> probs = sigmoid(logits);
    std::vector<int32_t> topk(T * k);
    for (int64_t t = 0; t < T; ++t)  // two distinct experts per row
        topk[t * k] = int32_t(t % E), topk[t * k + 1] = int32_t((t % E + 1 + t % 3) % E);
    std::vector<double> counts(D * E, -1), psum(D * E, -1);
    cpu::sequence_balance(probs.data(), topk.data(), doc_rows.data(), D, E, k, counts.data(),
                          psum.data());
    for (int64_t d = 0; d < D; ++d)
        for (int64_t e = 0; e < E; ++e) {
            double c = 0, p = 0;
            for (int64_t t = doc_rows[d]; t < doc_rows[d + 1]; ++t) {
                c += (topk[t * k] == e) + (topk[t * k + 1] == e);
                double z = 0;
                for (int64_t x = 0; x < E; ++x) z += probs[t * E + x];
                p += probs[t * E + e] / z;
            }
            EXPECT_EQ(counts[d * E + e], c) << "document " << d << ", expert " << e;
            EXPECT_NEAR(psum[d * E + e], p, 1e-14) << "document " << d << ", expert " << e;
        }
    // Counts sum to k per row; psum to 1 per row.
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), 0.0), double(k * 20));
    EXPECT_NEAR(std::accumulate(psum.begin(), psum.end(), 0.0), 20.0, 1e-12);
    std::vector<double> f(D * E), w = {0.3, 0.7, 0.2, 0.5};
    for (int64_t i = 0; i < D * E; ++i) f[i] = counts[i] * (1.0 + 0.1 * double(i % 3));
    const auto loss = [&](const std::vector<double>& l) {
        std::vector<double> s = sigmoid(l), c(D * E), p(D * E);
        cpu::sequence_balance(s.data(), topk.data(), doc_rows.data(), D, E, k, c.data(), p.data());
        double total = 0;
        for (int64_t i = 0; i < D * E; ++i) total += w[i / E] * f[i] * p[i];
        return total;
    };
    std::vector<double> dlogits(T * E, 0.25);  // added to
    cpu::sequence_aux_backward(probs.data(), doc_rows.data(), D, E, f.data(), w.data(),
                               dlogits.data());
    double largest = 0;
    for (int64_t i = 0; i < T * E; ++i) {
        std::vector<double> up = logits, down = logits;
        up[i] += 1e-6, down[i] -= 1e-6;
        const double fd = (loss(up) - loss(down)) / 2e-6;
        EXPECT_NEAR(dlogits[i] - 0.25, fd, 1e-8) << "logit " << i;
        largest = std::max(largest, std::abs(fd));
    }
    EXPECT_GT(largest, 1e-3) << "the check saw a gradient";
    for (int64_t i = 20 * E; i < T * E; ++i) EXPECT_EQ(dlogits[i], 0.25) << "padding row";
}
