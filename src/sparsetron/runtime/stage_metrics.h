// A step's per-stage figures put together under pipeline parallelism: each stage holds its own
// layers' routing statistics, and the metrics show every MoE layer of the model in layer order.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

// Each pipeline stage's vector, one after another in stage order (the layer order), on every
// rank: this rank's `mine` at its stage's offset (returned in `offset`), the rest zero, summed
// over `sum` (a group spanning the stages: the pipeline group, or every rank, which also adds
// a stage's replicas).
std::vector<double> stages_concatenated(Comm& pp, Comm& sum, const std::vector<double>& mine,
                                        size_t* offset = nullptr);
// The same with this rank's vector per chunk under interleaving (chunk v is stage v P + rank):
// stage order is the layer order; `offsets` gets each chunk's.
std::vector<double> stages_concatenated(Comm& pp, Comm& sum,
                                        const std::vector<std::vector<double>>& chunks,
                                        std::vector<size_t>* offsets);

// The metrics from the whole model's flat routing statistics (each MoE application's E loads
// then its dropped count, MTP's last): the backbone's MoE layers' loads, and the dropped rows of
// every application.
void moe_metrics_from_stages(const ModelConfig& m, const std::vector<double>& all,
                             std::vector<std::vector<int64_t>>& load, int64_t& dropped);

// The loads of this rank's MoE layers (already summed over the stage's ranks; `chunk_layers`:
// how many of them each of its chunks holds, one count without interleaving) and its dropped
// rows, made the whole model's over the pipeline group (one rank per pipeline rank).
void gather_stage_moe_metrics(Comm& pp, int64_t experts, const std::vector<size_t>& chunk_layers,
                              std::vector<std::vector<int64_t>>& load, int64_t& dropped);

}  // namespace sparsetron
