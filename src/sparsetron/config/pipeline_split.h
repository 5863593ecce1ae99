// The decoder layers of each pipeline stage (Megatron's keys): `decoder_first_pipeline_num_layers`
// and `decoder_last_pipeline_num_layers` fix the first and last stages' counts, the other layers
// are spread evenly over the remaining stages (which must divide them); without either key every
// stage gets num_layers / pipeline_model_parallel_size.
//
// Interleaved (virtual) stages: with V chunks per rank the model is cut into V x P stages, and
// pipeline rank r holds stages r, P + r, ..., (V - 1) P + r (Megatron's order: every rank's first
// chunk, then every rank's second). V comes from pipeline_model_parallel_layout (its stage count
// over P), num_virtual_stages_per_pipeline_rank or num_layers_per_virtual_pipeline_stage.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/pipeline_stage.h"
#include "sparsetron/config/run_config.h"

namespace sparsetron {

// Chunks per pipeline rank (1 without interleaving); throws naming the keys that disagree.
int64_t pipeline_virtual_stages(const ModelConfig& m, const RunConfig& r);
// Layers per stage, first stage first; throws naming the keys when they do not split.
std::vector<int64_t> pipeline_layer_counts(int64_t num_layers, int64_t stages, int64_t first,
                                           int64_t last);
// The recipe's layers per stage (V x P with interleaving): from pipeline_model_parallel_layout
// when set (with neither decoder_first/last key: they would say the same thing twice), else from
// the two keys (which interleaving does not take: the layout string says it exactly).
std::vector<int64_t> pipeline_stage_layers(const ModelConfig& m, const RunConfig& r);
// Stage `index` of the recipe's split (a virtual stage with interleaving).
PipelineStage pipeline_stage(const ModelConfig& m, const RunConfig& r, int index);
// The stages pipeline rank `pp_rank` holds, in the order it runs them: one without interleaving.
std::vector<PipelineStage> pipeline_rank_stages(const ModelConfig& m, const RunConfig& r,
                                                int pp_rank);

}  // namespace sparsetron
