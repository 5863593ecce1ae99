#include "sparsetron/model/param_table.h"

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

void add_swiglu(ParamStore& s, const std::string& p, int64_t hidden, int64_t ffn) {
    s.add(p + "gate_proj.weight", {ffn, hidden}, InitRule::Normal);
    s.add(p + "up_proj.weight", {ffn, hidden}, InitRule::Normal);
    s.add(p + "down_proj.weight", {hidden, ffn}, InitRule::ScaledNormal);
}

void add_attention(const ModelConfig& c, ParamStore& s, const std::string& p) {
    const int64_t h = c.hidden_size, H = c.num_attention_heads, qr = c.q_lora_rank,
                  kr = c.kv_lora_rank, dr = c.qk_pos_emb_head_dim;
    s.add(p + "q_a_proj.weight", {qr, h}, InitRule::Normal);
    s.add(p + "q_a_layernorm.weight", {qr}, InitRule::Ones, false);
    s.add(p + "q_b_proj.weight", {H * c.q_head_dim(), qr}, InitRule::Normal);
    s.add(p + "kv_a_proj_with_mqa.weight", {kr + dr, h}, InitRule::Normal);
    s.add(p + "kv_a_layernorm.weight", {kr}, InitRule::Ones, false);
    s.add(p + "kv_b_proj.weight", {H * (c.qk_head_dim + c.v_head_dim), kr}, InitRule::Normal);
    s.add(p + "o_proj.weight", {h, H * c.v_head_dim}, InitRule::ScaledNormal);
}

void add_indexer(const ModelConfig& c, ParamStore& s, const std::string& p) {
    const int64_t HI = c.dsa_indexer_n_heads, dI = c.dsa_indexer_head_dim;
    s.add(p + "wq_b.weight", {HI * dI, c.q_lora_rank}, InitRule::Normal);
    s.add(p + "wk.weight", {dI, c.hidden_size}, InitRule::Normal);
    s.add(p + "k_norm.weight", {dI}, InitRule::Ones, false);
    s.add(p + "k_norm.bias", {dI}, InitRule::Zeros, false);
    s.add(p + "weights_proj.weight", {HI, c.hidden_size}, InitRule::Normal);
}

}  // namespace

void add_moe_params(const ModelConfig& c, ParamStore& s, const std::string& p) {
    const int64_t E = c.num_experts, h = c.hidden_size, W = c.expert_parallel_ranks;
    s.add(p + "gate.weight", {E, h}, InitRule::Normal, false);
    s.add_buffer(p + "gate.e_score_correction_bias", {E}, InitRule::Zeros);
    ST_CHECK(W >= 1 && E % W == 0, "num_experts (", E,
             ") must be divisible by expert_model_parallel_size (", W, ")");
    ST_CHECK(c.expert_parallel_rank >= 0 && c.expert_parallel_rank < W, "expert-parallel rank ",
             c.expert_parallel_rank, " of ", W);
    // This rank's experts (all of them without expert parallelism), by their global index.
    const int64_t first = s.size();
    for (int64_t e = c.first_local_expert(); e < c.first_local_expert() + c.local_experts(); ++e)
        add_swiglu(s, cat(p, "experts.", e, "."), h, c.moe_ffn_hidden_size);
    s.set_routed_expert_from(first);
    if (c.moe_shared_expert_intermediate_size > 0)
        add_swiglu(s, p + "shared_experts.", h, c.moe_shared_expert_intermediate_size);
}

bool is_indexer_param(const std::string& name) {
    return name.find(".self_attn.indexer.") != std::string::npos;
}

// MTP layers take the kind of the last backbone layer (SPEC §8).
void add_decoder_layer_params(const ModelConfig& c, ParamStore& s, int64_t layer0) {
    const std::string p = cat("model.layers.", layer0, ".");
    const bool is_mtp = layer0 >= c.num_layers;
    s.add(p + "input_layernorm.weight", {c.hidden_size}, InitRule::Ones, false);
    add_attention(c, s, p + "self_attn.");
    if (c.uses_dsa() && dsa_layer_is_full(c, layer0)) add_indexer(c, s, p + "self_attn.indexer.");
    s.add(p + "post_attention_layernorm.weight", {c.hidden_size}, InitRule::Ones, false);
    if (c.is_moe_layer(is_mtp ? c.num_layers - 1 : layer0))
        add_moe_params(c, s, p + "mlp.");
    else
        add_swiglu(s, p + "mlp.", c.hidden_size, c.ffn_hidden_size);
}

namespace {

// The parameters of one stage into `store`.
void add_stage_params(const ModelConfig& cfg, ParamStore* store, const PipelineStage& stage) {
    const int64_t L0 = stage.first_layer,
                  L1 = stage.end_layer < 0 ? cfg.num_layers : stage.end_layer;
    ST_CHECK(static_cast<int64_t>(cfg.moe_layer_pattern.size()) == cfg.num_layers,
             "model: moe_layer_pattern has ", cfg.moe_layer_pattern.size(), " entries for ",
             cfg.num_layers, " layers (validate the recipe first)");
    ST_CHECK(0 <= L0 && L0 < L1 && L1 <= cfg.num_layers, "pipeline stage ", stage.index,
             ": layers [", L0, ", ", L1, ") of ", cfg.num_layers);
    ST_CHECK(
        stage.whole() || (stage.first() == (L0 == 0) && stage.last() == (L1 == cfg.num_layers)),
        "pipeline stage ", stage.index, " of ", stage.count, " holds layers [", L0, ", ", L1, ")");
    const int64_t h = cfg.hidden_size;
    // The MTP layer (on the last stage) reads the embedding table.
    if (stage.first() || (stage.last() && cfg.mtp_num_layers > 0)) {
        const int64_t e =
            store->add_embedding_like("model.embed_tokens.weight", {cfg.vocab_size, h});
        if (!stage.first()) store->mark_pipeline_copy(e);
    }
    for (int64_t l = L0; l < L1; ++l) add_decoder_layer_params(cfg, *store, l);
    if (!stage.last()) return;
    store->add("model.norm.weight", {h}, InitRule::Ones, false);
    store->add_embedding_like("lm_head.weight", {cfg.vocab_size, h});
    if (cfg.mtp_num_layers == 0) return;
    // Distinct MTP layers take the indices after the backbone's (HF's model.layers.{L + j}).
    const int64_t first = store->size();
    for (int64_t j = 0; j < cfg.mtp_physical_layers(); ++j) {
        const std::string p = cat("model.layers.", cfg.num_layers + j, ".");
        store->add(p + "enorm.weight", {h}, InitRule::Ones, false);
        store->add(p + "hnorm.weight", {h}, InitRule::Ones, false);
        store->add(p + "eh_proj.weight", {h, 2 * h}, InitRule::Normal);
        add_decoder_layer_params(cfg, *store, cfg.num_layers + j);
        store->add(p + "shared_head.norm.weight", {h}, InitRule::Ones, false);
    }
    store->set_mtp_from(first);
}

}  // namespace

std::unique_ptr<ParamStore> make_param_table(const ModelConfig& cfg, MemoryPlan& plan, DType dtype,
                                             const PipelineStage& stage) {
    return make_param_table(cfg, plan, dtype, std::vector<PipelineStage>{stage});
}

std::unique_ptr<ParamStore> make_param_table(const ModelConfig& cfg, MemoryPlan& plan, DType dtype,
                                             const std::vector<PipelineStage>& stages) {
    ST_CHECK(!stages.empty(), "a parameter table of no pipeline stage");
    auto store = std::make_unique<ParamStore>(plan, dtype);
    for (const PipelineStage& s : stages) add_stage_params(cfg, store.get(), s);
    return store;
}

}  // namespace sparsetron
