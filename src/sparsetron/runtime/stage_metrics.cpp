#include "sparsetron/runtime/stage_metrics.h"

#include <algorithm>

namespace sparsetron {

std::vector<double> stages_concatenated(Comm& pp, Comm& sum, const std::vector<double>& mine,
                                        size_t* offset) {
    std::vector<size_t> offsets;
    std::vector<double> all =
        stages_concatenated(pp, sum, std::vector<std::vector<double>>{mine}, &offsets);
    if (offset) *offset = offsets.front();
    return all;
}

std::vector<double> stages_concatenated(Comm& pp, Comm& sum,
                                        const std::vector<std::vector<double>>& chunks,
                                        std::vector<size_t>* offsets) {
    const size_t P = size_t(pp.size()), V = chunks.size();
    // sizes[v * P + r]: the size of stage v P + r (rank r's chunk v).
    std::vector<uint64_t> sizes;
    for (const auto& c : chunks) {
        const std::vector<uint64_t> s = pp.allgather(uint64_t(c.size()));
        sizes.insert(sizes.end(), s.begin(), s.end());
    }
    std::vector<size_t> at(V * P + 1, 0);
    for (size_t s = 0; s < V * P; ++s) at[s + 1] = at[s] + size_t(sizes[s]);
    std::vector<double> all(at.back(), 0.0);
    if (offsets) offsets->clear();
    for (size_t v = 0; v < V; ++v) {
        const size_t o = at[v * P + size_t(pp.rank())];
        std::copy(chunks[v].begin(), chunks[v].end(), all.begin() + std::ptrdiff_t(o));
        if (offsets) offsets->push_back(o);
    }
    sum.allreduce_sum(all.data(), int64_t(all.size()));
    return all;
}

void moe_metrics_from_stages(const ModelConfig& mc, const std::vector<double>& all,
                             std::vector<std::vector<int64_t>>& load, int64_t& dropped) {
    const int64_t E = mc.num_experts;
    int64_t backbone = 0;
    for (int64_t l = 0; l < mc.num_layers; ++l) backbone += mc.moe_layer_pattern[size_t(l)] ? 1 : 0;
    load.clear();
    dropped = 0;
    for (size_t at = 0, layer = 0; at < all.size(); at += size_t(E) + 1, ++layer) {
        if (int64_t(layer) < backbone)
            load.emplace_back(all.begin() + std::ptrdiff_t(at),
                              all.begin() + std::ptrdiff_t(at + size_t(E)));
        dropped += int64_t(all[at + size_t(E)]);
    }
}

void gather_stage_moe_metrics(Comm& pp, int64_t experts, const std::vector<size_t>& chunk_layers,
                              std::vector<std::vector<int64_t>>& load, int64_t& dropped) {
    std::vector<std::vector<double>> chunks;
    size_t layer = 0;
    for (const size_t n : chunk_layers) {
        chunks.emplace_back();
        for (size_t k = 0; k < n; ++k, ++layer)
            chunks.back().insert(chunks.back().end(), load[layer].begin(), load[layer].end());
    }
    std::vector<size_t> offsets;
    const std::vector<double> all = stages_concatenated(pp, pp, chunks, &offsets);
    const size_t E = size_t(experts);
    load.clear();
    for (size_t at = 0; E > 0 && at + E <= all.size(); at += E)
        load.emplace_back(all.begin() + std::ptrdiff_t(at), all.begin() + std::ptrdiff_t(at + E));
    double d = double(dropped);
    pp.allreduce_sum(&d, 1);
    dropped = int64_t(d);
}

}  // namespace sparsetron
