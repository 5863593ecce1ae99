// The decoder layers of each pipeline stage (Megatron's keys): `decoder_first_pipeline_num_layers`
// and `decoder_last_pipeline_num_layers` fix the first and last stages' counts, the other layers
// are spread evenly over the remaining stages (which must divide them); without either key every
// stage gets num_layers / pipeline_model_parallel_size.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/pipeline_stage.h"
#include "sparsetron/config/run_config.h"

namespace sparsetron {

// Layers per stage, first stage first; throws naming the keys when they do not split.
std::vector<int64_t> pipeline_layer_counts(int64_t num_layers, int64_t stages, int64_t first,
                                           int64_t last);
// The recipe's layers per stage: from pipeline_model_parallel_layout when set (with neither
// decoder_first/last key: they would say the same thing twice), else from the two keys.
std::vector<int64_t> pipeline_stage_layers(const ModelConfig& m, const RunConfig& r);
// Stage `index` of the recipe's split.
PipelineStage pipeline_stage(const ModelConfig& m, const RunConfig& r, int index);

}  // namespace sparsetron
