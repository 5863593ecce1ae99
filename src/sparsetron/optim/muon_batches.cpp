#include "sparsetron/optim/muon_batches.h"

#include <map>
#include <utility>

#include "sparsetron/core/error.h"

namespace sparsetron {

MuonProblem muon_problem_of(int64_t param, const MuonSlice& slice) {
    ST_CHECK(!slice.rows.empty(), "Muon slice of parameter ", param, " has no rows");
    MuonProblem p;
    p.param = param;
    p.row0 = slice.rows[0].first;
    p.seg_rows = slice.rows[0].second - slice.rows[0].first;
    p.seg_stride = slice.rows.size() > 1 ? slice.rows[1].first - slice.rows[0].first : p.seg_rows;
    for (size_t k = 0; k < slice.rows.size(); ++k) {
        const auto [b, e] = slice.rows[k];
        ST_CHECK(e - b == p.seg_rows && b == p.row0 + int64_t(k) * p.seg_stride,
                 "Muon slice of parameter ", param,
                 " is not equal segments at a constant stride (segment ", k, ": rows ", b, "..", e,
                 ")");
    }
    return p;
}

std::vector<MuonBatch> plan_muon_batches(const std::vector<MuonSplit>& splits,
                                         const std::vector<std::vector<int64_t>>& shapes,
                                         int64_t max_elements) {
    ST_CHECK(splits.size() == shapes.size(), "plan_muon_batches: ", splits.size(), " splits for ",
             shapes.size(), " shapes");
    // Shape -> its problems in parameter order.
    std::map<std::pair<int64_t, int64_t>, std::vector<MuonProblem>> by_shape;
    for (size_t i = 0; i < splits.size(); ++i)
        for (const MuonSlice& s : splits[i].slices) {
            ST_CHECK(shapes[i].size() == 2, "Muon parameter ", i, " is not 2-D");
            by_shape[{s.num_rows(), shapes[i][1]}].push_back(muon_problem_of(int64_t(i), s));
        }
    std::vector<MuonBatch> out;
    for (auto& [shape, problems] : by_shape) {
        const int64_t n = shape.first * shape.second;
        for (const MuonProblem& p : problems) {
            if (out.empty() || out.back().rows != shape.first || out.back().cols != shape.second ||
                out.back().elements() + n > max_elements) {
                out.push_back(MuonBatch{shape.first, shape.second, {}});
            }
            out.back().problems.push_back(p);
        }
    }
    return out;
}

}  // namespace sparsetron
