// Newton-Schulz batch planning and the distributed optimizer's owner assignment: every Muon slice
// lands in exactly one batch of its own shape, batches respect the element bound, per-projection
// slices become strided segments; owners are balanced and deterministic.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include "sparsetron/optim/muon_batches.h"
#include "sparsetron/optim/owner_assignment.h"

using namespace sparsetron;

namespace {

MuonSplit whole(int64_t rows) {
    MuonSplit s;
    s.slices.push_back({{{0, rows}}});
    return s;
}

}  // namespace

TEST(MuonBatches, EverySliceOnceShapesEqualBoundKept) {
    // Param 0: per-head split of a [4 x (3 + 2), 8] matrix; 1 and 3: two "experts" [4, 8];
    // 2: not Muon; 4: a [40, 8] matrix larger than the bound (a batch alone).
    MuonSplit heads;
    heads.kind = "per_head";
    for (int64_t h = 0; h < 4; ++h) {
        heads.slices.push_back({{{h * 5, h * 5 + 3}}});
        heads.slices.push_back({{{h * 5 + 3, h * 5 + 5}}});
    }
    const std::vector<MuonSplit> splits{heads, whole(4), MuonSplit{}, whole(4), whole(40)};
    const std::vector<std::vector<int64_t>> shapes{{20, 8}, {4, 8}, {7, 7}, {4, 8}, {40, 8}};
    const auto batches = plan_muon_batches(splits, shapes, /*max_elements=*/64);
    std::map<std::tuple<int64_t, int64_t>, int> seen;  // (param, row0) -> times
    for (const MuonBatch& b : batches) {
        ASSERT_GT(b.count(), 0);
        EXPECT_TRUE(b.count() == 1 || b.elements() <= 64) << b.rows << "x" << b.cols;
        for (const MuonProblem& p : b.problems) {
            ++seen[{p.param, p.row0}];
            EXPECT_EQ(p.seg_rows, b.rows);  // single-segment slices here
            EXPECT_EQ(shapes[p.param][1], b.cols);
        }
    }
    EXPECT_EQ(seen.size(), 8u + 2u + 1u);
    for (const auto& [key, times] : seen) EXPECT_EQ(times, 1);
    EXPECT_EQ(seen.count({2, 0}), 0u);  // the non-Muon parameter
    // 4 head slices of [3, 8] (96 elements) exceed 64: two per batch; [2, 8]: all four fit.
    int batches_3x8 = 0, batches_2x8 = 0, batches_4x8 = 0;
    for (const MuonBatch& b : batches) {
        batches_3x8 += b.rows == 3;
        batches_2x8 += b.rows == 2;
        batches_4x8 += b.rows == 4;
        if (b.rows == 40) {
            EXPECT_TRUE(b.transposed());
            EXPECT_EQ(b.rr(), 8);
            EXPECT_EQ(b.cc(), 40);
        }
    }
    EXPECT_EQ(batches_3x8, 2);
    EXPECT_EQ(batches_2x8, 1);
    EXPECT_EQ(batches_4x8, 1);  // the two experts of equal shape together (64 elements)
}

TEST(MuonBatches, PerProjectionSliceIsStridedSegments) {
    MuonSlice s;
    for (int64_t h = 0; h < 3; ++h) s.rows.push_back({h * 5 + 3, h * 5 + 5});
    const MuonProblem p = muon_problem_of(7, s);
    EXPECT_EQ(p.param, 7);
    EXPECT_EQ(p.row0, 3);
    EXPECT_EQ(p.seg_rows, 2);
    EXPECT_EQ(p.seg_stride, 5);
    MuonSlice uneven;
    uneven.rows = {{0, 2}, {5, 8}};
    EXPECT_THROW(muon_problem_of(0, uneven), std::exception);
}

TEST(OwnerAssignment, GreedyBalancedDeterministicAndSkipsUnowned) {
    const std::vector<double> cost{5, -1, 3, 3, 2, 1, 8, -1};
    const auto o = assign_owners_greedy(cost, 2);
    EXPECT_EQ(o, assign_owners_greedy(cost, 2));
    EXPECT_EQ(o[1], -1);
    EXPECT_EQ(o[7], -1);
    double load[2] = {0, 0};
    for (size_t i = 0; i < cost.size(); ++i)
        if (o[i] >= 0) load[o[i]] += cost[i];
    // 8 -> 0, 5 -> 1, 3 -> 1, 3 -> 0 (a tie: the first rank), 2 -> 1, 1 -> 1: 11 and 11.
    EXPECT_EQ(load[0], 11);
    EXPECT_EQ(load[1], 11);
    EXPECT_EQ(o[6], 0);
    EXPECT_EQ(o[3], 0);
    for (int r : assign_owners_greedy(cost, 1)) EXPECT_LE(r, 0);
    EXPECT_THROW(assign_owners_greedy(cost, 0), std::exception);
}
