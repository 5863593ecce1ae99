// Newton-Schulz batches (SPEC §7): the Muon matrices of a step grouped by shape, so that equal
// shapes (the 2 H per-head slices of an MLA up-projection, the experts of a MoE layer, the same
// projection across layers) are orthogonalized together by strided batched GEMMs instead of one
// small GEMM chain each. Host-side planning only; the CUDA optimizer runs the batches.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/optim/muon.h"

namespace sparsetron {

// One matrix of a batch: `rows` rows of parameter `param` (a [*, cols] matrix), taken as
// segments of `seg_rows` rows starting at row0, row0 + seg_stride, ... (one segment for a whole
// parameter or a per-head slice; one per head for a per-projection slice).
struct MuonProblem {
    int64_t param = 0;
    int64_t row0 = 0, seg_rows = 0, seg_stride = 0;
};

// Problems of one shape [rows, cols], at most `max_elements` matrix elements in all (a larger
// single matrix forms a batch alone).
struct MuonBatch {
    int64_t rows = 0, cols = 0;
    std::vector<MuonProblem> problems;
    int64_t count() const { return int64_t(problems.size()); }
    int64_t elements() const { return count() * rows * cols; }
    // Newton-Schulz works on the wide orientation [rr, cc], rr <= cc.
    bool transposed() const { return rows > cols; }
    int64_t rr() const { return transposed() ? cols : rows; }
    int64_t cc() const { return transposed() ? rows : cols; }
};

// The batches for parameters with these splits (an empty split: not a Muon parameter) and
// shapes [rows_i, cols_i]; every slice lands in exactly one batch. Order: by shape, then by
// parameter and slice, so a given recipe always gives the same batches.
std::vector<MuonBatch> plan_muon_batches(const std::vector<MuonSplit>& splits,
                                         const std::vector<std::vector<int64_t>>& shapes,
                                         int64_t max_elements);

// A slice as a problem: its row ranges must be equal-length segments at a constant stride.
MuonProblem muon_problem_of(int64_t param, const MuonSlice& slice);

}  // namespace sparsetron
