#include "sparsetron/parallel/layout/layout.h"

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

std::vector<int> strided(int first, int count, int stride) {
    std::vector<int> out;
    for (int i = 0; i < count; ++i) out.push_back(first + i * stride);
    return out;
}

bool power_of_two(int x) {
    return x > 0 && (x & (x - 1)) == 0;
}

}  // namespace

std::vector<int> ParallelLayout::cp_group(int rank) const {
    return strided(pp_rank(rank) * stage_size() + dp_rank(rank) * cp, cp, 1);
}
std::vector<int> ParallelLayout::dp_group(int rank) const {
    return strided(pp_rank(rank) * stage_size() + cp_rank(rank), dp, cp);
}
std::vector<int> ParallelLayout::ep_group(int rank) const {
    return strided(pp_rank(rank) * stage_size() + edp_rank(rank) * ep, ep, 1);
}
std::vector<int> ParallelLayout::edp_group(int rank) const {
    return strided(pp_rank(rank) * stage_size() + ep_rank(rank), edp(), ep);
}
std::vector<int> ParallelLayout::stage_group(int rank) const {
    return strided(pp_rank(rank) * stage_size(), stage_size(), 1);
}
std::vector<int> ParallelLayout::pp_group(int rank) const {
    return strided(stage_rank(rank), pp, stage_size());
}

std::vector<int> ParallelLayout::dynamic_cp_group(int rank, int size) const {
    ST_CHECK(power_of_two(size) && size <= stage_size() && stage_size() % size == 0,
             "dynamic CP: a group of ", size, " ranks out of ", stage_size(),
             " (sizes are powers of two dividing the DP x CP ranks)");
    return strided(rank / size * size, size, 1);
}

std::vector<int> ParallelLayout::dynamic_cp_sizes(int min_size) const {
    std::vector<int> out;
    for (int s = std::max(1, min_size); s <= stage_size(); s *= 2)
        if (stage_size() % s == 0) out.push_back(s);
    return out;
}

std::string ParallelLayout::describe() const {
    const std::string stages =
        pp > 1 ? cat("PP ", pp, " stages of ", stage_size(), " ranks: ") : "";
    return cat(world, " ranks: ", stages, "DP ", dp, " x CP ", cp, " (dense), EP ", ep, " x EDP ",
               edp(), " (experts)");
}

ParallelLayout make_layout(const RunConfig& run, int world) {
    ST_CHECK(run.tensor_model_parallel_size == 1, "tensor parallelism is not supported (size ",
             run.tensor_model_parallel_size, ")");
    ParallelLayout l;
    l.world = world;
    l.pp = int(run.pipeline_model_parallel_size);
    ST_CHECK(l.pp >= 1 && world % l.pp == 0, "pipeline_model_parallel_size ", l.pp,
             " does not divide the ", world, " ranks");
    const int stage = world / l.pp;
    l.cp = int(run.context_parallel_size);
    l.ep = int(run.expert_model_parallel_size);
    ST_CHECK(l.cp >= 1 && stage % l.cp == 0, "context_parallel_size ", l.cp,
             " does not divide the ", stage, " ranks of a pipeline stage");
    ST_CHECK(l.ep >= 1 && stage % l.ep == 0, "expert_model_parallel_size ", l.ep,
             " does not divide the ", stage,
             " ranks of a pipeline stage (experts fold CP into their data dimension)");
    l.dp = stage / l.cp;
    return l;
}

}  // namespace sparsetron
