#include "sparsetron/optim/owner_assignment.h"

#include <algorithm>
#include <utility>

#include "sparsetron/core/error.h"

namespace sparsetron {

std::vector<int> assign_owners_greedy(const std::vector<double>& cost, int ranks) {
    ST_CHECK(ranks >= 1, "assign_owners_greedy: ", ranks, " ranks");
    std::vector<std::pair<double, size_t>> order;
    for (size_t i = 0; i < cost.size(); ++i)
        if (cost[i] >= 0) order.emplace_back(cost[i], i);
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<double> load(size_t(ranks), 0.0);
    std::vector<int> owner(cost.size(), -1);
    for (const auto& [c, i] : order) {
        const int r = int(std::min_element(load.begin(), load.end()) - load.begin());
        owner[i] = r;
        load[size_t(r)] += c;
    }
    return owner;
}

}  // namespace sparsetron
