// The pipeline timetable (runtime/pipeline_timetable.h): each rank's order is Megatron's (1F1B,
// and its interleaved form), and the ticks it places them at run every piece of work after its
// input exists, deliver every message exactly once to the rank and chunk that reads it, and bound
// what a rank holds.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include "sparsetron/core/error.h"
#include "sparsetron/runtime/pipeline_timetable.h"

using namespace sparsetron;

namespace {

std::string describe(const std::vector<PipelineWork>& order) {
    std::string s;
    for (const PipelineWork& w : order)
        s += std::string(w.backward ? "B" : "F") + std::to_string(w.micro_batch) + "." +
             std::to_string(w.chunk) + " ";
    return s;
}

}  // namespace

// One stage per rank: warm-up forwards (P - rank - 1), then one forward and one backward in
// turn, then the remaining backwards. Interleaved, two ranks and two chunks over four
// micro-batches: Megatron's warm-up of 2 (P - rank - 1) + (V - 1) P, micro-batches in groups of
// P through chunk 0 then chunk 1, backwards from the last chunk; the last stage's backward
// always right after its forward.
TEST(PipelineTimetable, EachRanksOrderIsMegatrons) {
    EXPECT_EQ(describe(pipeline_rank_order(1, 4, 1, 4, true)),
              "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 B2.0 B3.0 ");
    EXPECT_EQ(describe(pipeline_rank_order(3, 4, 1, 3, true)), "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 ");
    EXPECT_EQ(describe(pipeline_rank_order(0, 2, 2, 4, true)),
              "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0 ");
    // Rank 1 (the last): warm-up 2 (2 - 1 - 1) + 2 = 2.
    const auto r1 = pipeline_rank_order(1, 2, 2, 4, true);
    EXPECT_EQ(describe({r1.begin(), r1.begin() + 4}), "F0.0 F1.0 F0.1 B0.1 ");
    // As many micro-batches as ranks: the first rank's warm-up is every forward; the last
    // stage still runs each backward right after its forward (not Megatron's all-warm-up).
    EXPECT_EQ(describe(pipeline_rank_order(0, 2, 2, 2, true)),
              "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0 ");
    EXPECT_EQ(describe(pipeline_rank_order(1, 2, 2, 2, true)),
              "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0 ");
    EXPECT_EQ(describe(pipeline_rank_order(0, 2, 2, 2, false)), "F0.0 F1.0 F0.1 F1.1 ");
    EXPECT_THROW(pipeline_rank_order(0, 2, 2, 3, true), Error);  // not a multiple of P
}

// Every layout of a few ranks, chunks and micro-batch counts, forward only and with backward:
// each rank runs its order exactly, each piece after its input (the previous stage's forward,
// the next stage's backward; a backward after its own forward), each message goes from the rank
// that produced it to the one that reads it, once, and arrives before it is read.
TEST(PipelineTimetable, EveryWorkRunsAfterItsInputAndEveryMessageIsReadOnce) {
    for (int P : {1, 2, 3, 4})
        for (int V : {1, 2, 3})
            for (int64_t n : {1, 2, 4, 6, 8, 12})
                for (bool bwd : {true, false}) {
                    if ((V > 1 && (P == 1 || n % P != 0))) continue;
                    const std::string tag = "P" + std::to_string(P) + " V" + std::to_string(V) +
                                            " n" + std::to_string(n) + (bwd ? " fwd+bwd" : " fwd");
                    const PipelineTimetable tt(P, V, n, bwd);
                    const int S = P * V;
                    std::map<std::tuple<bool, int64_t, int>, int64_t> tick_of;  // (bwd, mb, stage)
                    std::map<std::tuple<bool, int64_t, int>, int64_t> arrived;
                    for (int r = 0; r < P; ++r) {
                        int64_t ran = 0;
                        for (int64_t t = 0; t < tt.ticks(); ++t) {
                            const PipelineWork* w = tt.at(r, t);
                            if (!w) continue;
                            EXPECT_EQ(tt.index_at(r, t), ran) << tag << ": rank " << r;
                            ++ran;
                            tick_of[{w->backward, w->micro_batch, w->chunk * P + r}] = t;
                        }
                        EXPECT_EQ(ran, int64_t(tt.order(r).size())) << tag;
                        EXPECT_EQ(ran, n * V * (bwd ? 2 : 1)) << tag;
                        for (int64_t t = 0; t < tt.ticks(); ++t)
                            for (bool fwd : {true, false}) {
                                PipelineWork feeds;
                                if (!tt.receives(r, t, fwd, &feeds)) continue;
                                const auto key = std::make_tuple(feeds.backward, feeds.micro_batch,
                                                                 feeds.chunk * P + r);
                                EXPECT_EQ(arrived.count(key), 0u) << tag << ": twice";
                                arrived[key] = t;
                            }
                    }
                    ASSERT_EQ(int64_t(tick_of.size()), n * S * (bwd ? 2 : 1)) << tag;
                    for (const auto& [key, t] : tick_of) {
                        const auto [b, mb, s] = key;
                        const bool reads = b ? s < S - 1 : s > 0;
                        if (b) {
                            EXPECT_LT(tick_of.at({false, mb, s}), t) << tag;
                        }
                        if (!reads) {
                            EXPECT_EQ(arrived.count(key), 0u) << tag;
                            continue;
                        }
                        const int64_t made = tick_of.at({b, mb, b ? s + 1 : s - 1});
                        ASSERT_EQ(arrived.count(key), 1u) << tag << ": never delivered";
                        EXPECT_EQ(arrived.at(key), made) << tag << ": delivered after its tick";
                        EXPECT_LT(made, t) << tag << ": read before it was made";
                    }
                    EXPECT_EQ(arrived.size(), size_t(std::count_if(tick_of.begin(), tick_of.end(),
                                                                   [&](auto& kv) {
                                                                       const auto [b, mb, s] =
                                                                           kv.first;
                                                                       return b ? s < S - 1 : s > 0;
                                                                   })))
                        << tag;
                    for (int r = 0; r < P; ++r) {
                        EXPECT_GE(tt.held_messages(r), P > 1 && (bwd || r > 0 || V > 1) ? 1 : 0)
                            << tag;
                        // 1F1B keeps at most P - rank forwards (Megatron's bound).
                        if (V == 1 && bwd) {
                            EXPECT_LE(tt.kept_activations(r), P - r) << tag;
                        }
                        if (!bwd) {
                            EXPECT_EQ(tt.kept_activations(r), 0) << tag;
                        }
                    }
                }
}

// What the CUDA pipeline holds (runtime/cuda/cuda_pipeline.h): forward messages until the
// backward of the chunk they feed (it runs that chunk's forward again from them), gradients until
// their backward. Counted here by walking the ticks (a work's messages freed before the tick's
// arrivals), against the timetable's counts; 1F1B keeps P - rank + 1 inputs on every stage but
// the first (Megatron's in-flight bound, and the next micro-batch's, which arrives at the end of
// the tick before the backward frees one) and one gradient; and past the warm-up a few more groups
// of P micro-batches hold no more, which is what lets the CUDA plan bound a step of any count
// (dynamic CP).
TEST(PipelineTimetable, HeldInputsAndGradientsBoundTheCudaPipeline) {
    for (int P : {2, 3, 4})
        for (int V : {1, 2, 3}) {
            const int64_t unit = V > 1 ? P : 1;
            std::vector<int64_t> inputs(size_t(P), 0), grads(size_t(P), 0);
            for (int64_t k = 1; k <= 3 * (V + 3); ++k)
                for (bool bwd : {true, false}) {
                    const int64_t n = k * unit;
                    const std::string tag = "P" + std::to_string(P) + " V" + std::to_string(V) +
                                            " n" + std::to_string(n) + (bwd ? " fwd+bwd" : " fwd");
                    const PipelineTimetable tt(P, V, n, bwd);
                    for (int r = 0; r < P; ++r) {
                        std::set<std::pair<int64_t, int>> in, g;  // (micro-batch, chunk)
                        int64_t most_in = 0, most_g = 0;
                        for (int64_t t = 0; t < tt.ticks(); ++t) {
                            if (const PipelineWork* w = tt.at(r, t); w && w->backward == bwd) {
                                in.erase({w->micro_batch, w->chunk});
                                g.erase({w->micro_batch, w->chunk});
                            }
                            for (bool fwd : {true, false}) {
                                PipelineWork feeds;
                                if (!tt.receives(r, t, fwd, &feeds)) continue;
                                auto& held = fwd ? in : g;
                                EXPECT_TRUE(held.insert({feeds.micro_batch, feeds.chunk}).second);
                            }
                            most_in = std::max(most_in, int64_t(in.size()));
                            most_g = std::max(most_g, int64_t(g.size()));
                        }
                        EXPECT_TRUE(in.empty() && g.empty()) << tag;
                        EXPECT_EQ(tt.held_inputs(r), most_in) << tag << " rank " << r;
                        EXPECT_EQ(tt.held_gradients(r), most_g) << tag << " rank " << r;
                        if (V == 1 && bwd) {
                            EXPECT_EQ(most_in, r == 0 ? 0 : std::min<int64_t>(P - r + 1, n))
                                << tag << " rank " << r;
                            EXPECT_EQ(most_g, r == P - 1 ? 0 : 1) << tag << " rank " << r;
                        }
                        if (k <= V + 3) {
                            inputs[size_t(r)] = std::max(inputs[size_t(r)], most_in);
                            grads[size_t(r)] = std::max(grads[size_t(r)], most_g);
                        } else {
                            EXPECT_LE(most_in, inputs[size_t(r)]) << tag << " rank " << r;
                            EXPECT_LE(most_g, grads[size_t(r)]) << tag << " rank " << r;
                        }
                    }
                }
        }
}
