// The one parameter table of a model (DESIGN §3), built from its config alone: every parameter of
// the part of the model a pipeline stage holds, with its HuggingFace name, shape, optimizer group
// and flags, its value and gradient planned into a memory plan. Both backends' models bind this
// table (the CPU model by name, the CUDA model by copying its entries into the device plan), so
// a run builds it once and a CUDA run needs no CPU model for it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/pipeline_stage.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/param_store.h"

namespace sparsetron {

// The parameters of `stage` (the whole model by default) in the order the modules read them:
// the embedding (on the first stage; on the last too, as a pipeline copy, when MTP reads it),
// each decoder layer's (input norm, MLA projections, the DSA indexer on full layers, post norm,
// the dense MLP or the router, this rank's routed experts and the shared expert), the final norm
// and head, then each distinct MTP layer's. Routed experts are this expert-parallel rank's
// (cfg.expert_parallel_rank of cfg.expert_parallel_ranks). Values and gradients in `dtype`.
std::unique_ptr<ParamStore> make_param_table(const ModelConfig& cfg, MemoryPlan& plan, DType dtype,
                                             const PipelineStage& stage = {});
// One table of several stages (a pipeline rank's chunks under interleaving), each stage's
// parameters in turn: every chunk's model binds it by name.
std::unique_ptr<ParamStore> make_param_table(const ModelConfig& cfg, MemoryPlan& plan, DType dtype,
                                             const std::vector<PipelineStage>& stages);

// One module's parameters, as make_param_table adds them (tests of a single module build its
// table with these): decoder layer `layer0` (MTP layers numbered after the backbone's), and an
// MoE block under `prefix` ("model.layers.<l>.mlp.").
void add_decoder_layer_params(const ModelConfig& cfg, ParamStore& store, int64_t layer0);
void add_moe_params(const ModelConfig& cfg, ParamStore& store, const std::string& prefix);

// A DSA indexer's parameter ("...self_attn.indexer.*"): what the dense warm-up trains.
bool is_indexer_param(const std::string& name);

}  // namespace sparsetron
