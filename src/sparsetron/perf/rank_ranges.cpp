#include "sparsetron/perf/rank_ranges.h"

#include <algorithm>
#include <bit>
#include <cstdint>

namespace sparsetron {

std::vector<RankRange> ranges_across_ranks(Comm* comm, const std::vector<double>& mine) {
    std::vector<RankRange> out;
    for (const double v : mine) {
        RankRange r{v, v};
        if (comm && comm->size() > 1)
            for (const uint64_t bits : comm->allgather(std::bit_cast<uint64_t>(v))) {
                const double x = std::bit_cast<double>(bits);
                r.min = std::min(r.min, x), r.max = std::max(r.max, x);
            }
        out.push_back(r);
    }
    return out;
}

}  // namespace sparsetron
