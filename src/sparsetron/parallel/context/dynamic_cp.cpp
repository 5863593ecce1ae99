#include "sparsetron/parallel/context/dynamic_cp.h"

#include <algorithm>
#include <numeric>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

double workload(const DynamicCpGroup& g, const std::vector<int64_t>& lengths) {
    double w = 0;
    for (int s : g.samples) w += double(lengths[size_t(s)]) * double(lengths[size_t(s)]);
    return w / double(g.size);
}

bool block_free(const std::vector<bool>& busy, int first, int size) {
    for (int r = first; r < first + size; ++r)
        if (busy[size_t(r)]) return false;
    return true;
}

void mark(std::vector<bool>& busy, int first, int size) {
    for (int r = first; r < first + size; ++r) busy[size_t(r)] = true;
}

}  // namespace

int dynamic_cp_size(int64_t length, int64_t max_per_rank, int min_cp) {
    ST_CHECK(max_per_rank > 0, "max_seqlen_per_dp_cp_rank must be positive");
    const int64_t need = std::max<int64_t>(min_cp, (length + max_per_rank - 1) / max_per_rank);
    int size = 1;
    while (size < need) size *= 2;
    return size;
}

std::vector<DynamicCpMicroBatch> schedule_dynamic_cp(const std::vector<int64_t>& lengths, int ranks,
                                                     int64_t max_per_rank, int min_cp) {
    ST_CHECK(ranks > 0 && (ranks & (ranks - 1)) == 0, "dynamic CP needs a power-of-two number of ",
             "DP x CP ranks, not ", ranks);
    std::vector<int> order(lengths.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return lengths[size_t(a)] > lengths[size_t(b)]; });
    for (int s : order) {
        const int64_t len = lengths[size_t(s)];
        ST_CHECK(dynamic_cp_size(len, max_per_rank, min_cp) <= ranks, "a sample of ", len,
                 " tokens needs more than the ", ranks, " DP x CP ranks at ", max_per_rank,
                 " tokens per rank: raise max_seqlen_per_dp_cp_rank");
    }
    std::vector<DynamicCpMicroBatch> out;
    while (!order.empty()) {
        DynamicCpMicroBatch mb;
        std::vector<bool> busy(size_t(ranks), false);
        std::vector<int> later;
        for (int s : order) {
            const int64_t len = lengths[size_t(s)];
            const int size = dynamic_cp_size(len, max_per_rank, min_cp);
            // Free ranks first (spreads the work), then the least loaded group of this size
            // with room.
            DynamicCpGroup* best = nullptr;
            for (int first = 0; first + size <= ranks; first += size)
                if (block_free(busy, first, size)) {
                    mark(busy, first, size);
                    mb.groups.push_back(DynamicCpGroup{first, size, {}, 0});
                    best = &mb.groups.back();
                    break;
                }
            if (!best)
                for (auto& g : mb.groups)
                    if (g.size == size && g.tokens + len <= int64_t(size) * max_per_rank &&
                        (!best || workload(g, lengths) < workload(*best, lengths)))
                        best = &g;
            if (!best) {
                later.push_back(s);
                continue;
            }
            best->samples.push_back(s);
            best->tokens += len;
        }
        // Idle ranks: a group whose aligned neighbour of the same size is free doubles into it.
        for (bool grew = true; grew;) {
            grew = false;
            std::vector<size_t> by_size(mb.groups.size());
            std::iota(by_size.begin(), by_size.end(), size_t(0));
            std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
                return mb.groups[a].size < mb.groups[b].size;
            });
            for (size_t i : by_size) {
                DynamicCpGroup& g = mb.groups[i];
                const int buddy = g.first_rank ^ g.size;
                if (2 * g.size > ranks || !block_free(busy, buddy, g.size)) continue;
                mark(busy, buddy, g.size);
                g.first_rank = std::min(g.first_rank, buddy);
                g.size *= 2;
                grew = true;
                break;
            }
        }
        mb.idle_ranks = int(std::count(busy.begin(), busy.end(), false));
        std::sort(mb.groups.begin(), mb.groups.end(),
                  [](const DynamicCpGroup& a, const DynamicCpGroup& b) {
                      return a.first_rank < b.first_rank;
                  });
        out.push_back(std::move(mb));
        order = std::move(later);
    }
    return out;
}

}  // namespace sparsetron
