// The tracker's cross-rank columns (the seed's "p95 range" and "CV range"): each rank's figure of
// a timed run gathered over the job, reported as the smallest and the largest.
#pragma once

#include <vector>

#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

struct RankRange {
    double min = 0, max = 0;
};

// For each of this rank's values, the range over every rank of `comm` (a collective: every rank
// calls it with as many values); without a communicator, or alone, each value's own.
std::vector<RankRange> ranges_across_ranks(Comm* comm, const std::vector<double>& mine);

}  // namespace sparsetron
