#include "sparsetron/optim/owner_assignment.h"

#include <algorithm>
#include <map>
#include <string>
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

std::vector<int> parameter_owners(const ParamStore& store, const RunConfig& run, int ranks) {
    const auto& params = store.params();
    const bool muon = run.optimizer == "muon";
    const bool sharded = run.expert_model_parallel_size > 1;
    std::vector<double> cost(params.size(), -1.0);
    for (size_t i = 0; i < params.size(); ++i) {
        if (!params[i].trainable || (sharded && params[i].routed_expert)) continue;
        // What the owner keeps: the fp32 master and Muon's momentum or AdamW's two moments.
        const bool muon_param =
            muon && params[i].group == OptimGroup::Muon && params[i].shape.size() == 2;
        cost[i] = double(params[i].numel()) * (muon_param ? 2.0 : 3.0);
    }
    // AdamW's matrices (the embedding-like ones: never read through FP8 or as fp32 masters)
    // split by rows where the ranks divide them; the rest to owners by cost.
    std::vector<bool> split(params.size(), false);
    for (size_t i = 0; i < params.size(); ++i)
        if (cost[i] >= 0 && params[i].group == OptimGroup::AdamW && params[i].shape.size() == 2 &&
            params[i].shape[0] % ranks == 0) {
            split[i] = true;
            cost[i] = -1;
        }
    std::vector<int> owner = assign_owners_greedy(cost, ranks);
    for (size_t i = 0; i < params.size(); ++i)
        if (split[i]) owner[i] = kRowSplit;
    return owner;
}

void gather_row_shares(Comm& comm, void* data, int64_t bytes) {
    const int64_t share = bytes / comm.size();
    ST_ASSERT(share * comm.size() == bytes, "a row-split tensor of ", bytes, " bytes over ",
              comm.size(), " ranks");
    for (int r = 0; r < comm.size(); ++r)
        comm.broadcast(static_cast<char*>(data) + r * share, share, r);
}

OptimizerShard optimizer_shard(const ParamStore& params, const RunConfig& run, int rank,
                               int ranks) {
    ST_CHECK(0 <= rank && rank < ranks, "optimizer shard: rank ", rank, " of ", ranks);
    OptimizerShard s;
    if (!run.use_distributed_optimizer || ranks == 1) return s;
    s.rank = rank, s.ranks = ranks;
    s.owner = parameter_owners(params, run, ranks);
    return s;
}

OptimizerShard planned_optimizer_shard(const ParamStore& params, const RunConfig& run, int rank) {
    const int ranks = int(std::max<int64_t>(
        1, run.world_size / std::max<int64_t>(1, run.pipeline_model_parallel_size)));
    return optimizer_shard(params, run, rank, ranks);
}

void broadcast_state_from_owners(Comm& comm, const ParamStore& store, const Optimizer& optimizer,
                                 const MemoryPlan& plan, const std::vector<int>& owner) {
    const auto& params = store.params();
    std::map<std::string, int> owner_of;
    for (size_t i = 0; i < params.size(); ++i) owner_of[params[i].name] = owner[i];
    for (const auto& [name, slot] : optimizer.state_tensors()) {
        const auto it = owner_of.find(name.substr(0, name.rfind('.')));
        ST_ASSERT(it != owner_of.end(), "state tensor ", name, " has no parameter");
        if (it->second == kRowSplit)
            gather_row_shares(comm, plan.view(slot).data, int64_t(plan.entries()[slot].bytes));
        else if (it->second >= 0)
            comm.broadcast(plan.view(slot).data, int64_t(plan.entries()[slot].bytes), it->second);
    }
}

}  // namespace sparsetron
