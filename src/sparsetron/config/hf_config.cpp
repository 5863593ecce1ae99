#include "sparsetron/config/hf_config.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sparsetron/core/error.h"

namespace sparsetron {

using nlohmann::json;

std::string hf_config_json(const ModelConfig& m) {
    json j;
    j["model_type"] = "glm_moe_dsa";
    j["architectures"] = {"GlmMoeDsaForCausalLM"};
    j["vocab_size"] = m.vocab_size;
    j["hidden_size"] = m.hidden_size;
    j["intermediate_size"] = m.ffn_hidden_size;
    j["num_hidden_layers"] = m.num_layers;
    j["num_attention_heads"] = m.num_attention_heads;
    j["num_key_value_heads"] = m.num_attention_heads;
    j["q_lora_rank"] = m.q_lora_rank;
    j["kv_lora_rank"] = m.kv_lora_rank;
    j["qk_nope_head_dim"] = m.qk_head_dim;
    j["qk_rope_head_dim"] = m.qk_pos_emb_head_dim;
    j["v_head_dim"] = m.v_head_dim;
    j["rms_norm_eps"] = m.norm_epsilon;
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", m.rotary_base}};
    j["rope_interleave"] = m.rotary_interleaved;
    j["initializer_range"] = m.init_method_std;
    j["tie_word_embeddings"] = !m.untie_embeddings_and_output_weights;
    j["attention_bias"] = false;
    std::vector<std::string> types;
    int64_t first_dense = 0;
    for (int64_t l = 0; l < m.num_layers; ++l) {
        types.push_back(m.is_moe_layer(l) ? "sparse" : "dense");
        if (!m.is_moe_layer(l) && first_dense == l) ++first_dense;
    }
    j["mlp_layer_types"] = types;
    j["first_k_dense_replace"] = first_dense;
    j["moe_intermediate_size"] = m.moe_ffn_hidden_size;
    j["n_routed_experts"] = m.num_experts;
    j["num_experts_per_tok"] = m.moe_router_topk;
    j["n_shared_experts"] = m.moe_ffn_hidden_size > 0
                                ? m.moe_shared_expert_intermediate_size / m.moe_ffn_hidden_size
                                : 0;
    j["routed_scaling_factor"] = m.moe_router_topk_scaling_factor;
    j["norm_topk_prob"] = true;
    j["n_group"] = 1;
    j["topk_group"] = 1;
    j["topk_method"] = "noaux_tc";
    j["scoring_func"] = "sigmoid";
    if (m.uses_dsa()) {
        j["index_n_heads"] = m.dsa_indexer_n_heads;
        j["index_head_dim"] = m.dsa_indexer_head_dim;
        j["index_topk"] = m.dsa_indexer_topk;
        j["index_topk_freq"] = m.dsa_indexer_topk_freq;
        j["index_skip_topk_offset"] = m.dsa_indexer_skip_topk_offset;
        j["indexer_rope_interleave"] = m.dsa_indexer_rope_interleaved;
        if (!m.indexer_types.empty()) j["indexer_types"] = m.indexer_types;
    }
    j["num_nextn_predict_layers"] = m.mtp_physical_layers();
    return j.dump(2) + "\n";
}

namespace {

template <typename T>
T get(const json& j, const char* key, const std::string& path) {
    ST_CHECK(j.contains(key), path, ": config.json lacks required key '", key, "'");
    try {
        return j.at(key).get<T>();
    } catch (const json::exception&) {
        throw Error(cat(path, ": config.json key '", key, "' has the wrong type"));
    }
}

template <typename T>
T get_or(const json& j, const char* key, T fallback, const std::string& path) {
    return j.contains(key) && !j.at(key).is_null() ? get<T>(j, key, path) : fallback;
}

}  // namespace

ModelConfig parse_hf_config(const std::string& text, const std::string& path) {
    json j;
    try {
        j = json::parse(text);
    } catch (const json::exception& e) {
        throw Error(cat(path, ": invalid JSON: ", e.what()));
    }
    std::string type = get_or<std::string>(j, "model_type", "", path);
    ST_CHECK(type == "glm_moe_dsa" || type == "deepseek_v32" || type == "deepseek_v3", path,
             ": model_type is '", type, "'; expected glm_moe_dsa");
    ModelConfig m;
    m.vocab_size = get<int64_t>(j, "vocab_size", path);
    m.hidden_size = get<int64_t>(j, "hidden_size", path);
    m.ffn_hidden_size = get<int64_t>(j, "intermediate_size", path);
    m.num_layers = get<int64_t>(j, "num_hidden_layers", path);
    m.num_attention_heads = get<int64_t>(j, "num_attention_heads", path);
    m.q_lora_rank = get<int64_t>(j, "q_lora_rank", path);
    m.kv_lora_rank = get<int64_t>(j, "kv_lora_rank", path);
    m.qk_head_dim = get<int64_t>(j, "qk_nope_head_dim", path);
    m.qk_pos_emb_head_dim = get<int64_t>(j, "qk_rope_head_dim", path);
    m.v_head_dim = get<int64_t>(j, "v_head_dim", path);
    m.norm_epsilon = get_or<double>(j, "rms_norm_eps", 1e-5, path);
    m.init_method_std = get_or<double>(j, "initializer_range", 0.02, path);
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
        m.rotary_base = get_or<double>(j["rope_parameters"], "rope_theta", 1e6, path);
    else
        m.rotary_base = get_or<double>(j, "rope_theta", 1e6, path);
    m.rotary_interleaved = get_or<bool>(j, "rope_interleave", true, path);
    m.untie_embeddings_and_output_weights = !get_or<bool>(j, "tie_word_embeddings", false, path);

    m.moe_ffn_hidden_size = get_or<int64_t>(j, "moe_intermediate_size", 0, path);
    m.num_experts = get_or<int64_t>(j, "n_routed_experts", 0, path);
    m.moe_router_topk = get_or<int64_t>(j, "num_experts_per_tok", 0, path);
    m.moe_shared_expert_intermediate_size =
        get_or<int64_t>(j, "n_shared_experts", 0, path) * m.moe_ffn_hidden_size;
    m.moe_router_topk_scaling_factor = get_or<double>(j, "routed_scaling_factor", 1.0, path);
    m.moe_layer_pattern.assign(m.num_layers, 0);
    if (j.contains("mlp_layer_types")) {
        auto types = get<std::vector<std::string>>(j, "mlp_layer_types", path);
        ST_CHECK(static_cast<int64_t>(types.size()) == m.num_layers, path, ": mlp_layer_types has ",
                 types.size(), " entries for ", m.num_layers, " layers");
        for (int64_t l = 0; l < m.num_layers; ++l) m.moe_layer_pattern[l] = types[l] == "sparse";
    } else if (m.num_experts > 0) {
        int64_t k = get_or<int64_t>(j, "first_k_dense_replace", 0, path);
        for (int64_t l = k; l < m.num_layers; ++l) m.moe_layer_pattern[l] = 1;
    }
    std::string freq = "[";
    for (int64_t l = 0; l < m.num_layers; ++l) {
        // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on
        // const char* + std::string&& here.
        if (l) freq += ',';
        freq += std::to_string(m.moe_layer_pattern[l]);
    }
    m.moe_layer_freq = freq + "]";

    if (j.contains("index_topk") && !j["index_topk"].is_null()) {
        m.experimental_attention_variant = "dsa";
        m.dsa_indexer_topk = get<int64_t>(j, "index_topk", path);
        m.dsa_indexer_n_heads = get<int64_t>(j, "index_n_heads", path);
        m.dsa_indexer_head_dim = get<int64_t>(j, "index_head_dim", path);
        m.dsa_indexer_topk_freq = get_or<int64_t>(j, "index_topk_freq", 1, path);
        // HF's defaults: offset 2; glm_moe_dsa's indexer RoPE is interleaved (hard-coded there).
        m.dsa_indexer_skip_topk_offset = get_or<int64_t>(j, "index_skip_topk_offset", 2, path);
        m.dsa_indexer_rope_interleaved =
            get_or<bool>(j, "indexer_rope_interleave", type == "glm_moe_dsa", path);
        if (j.contains("indexer_types") && j["indexer_types"].is_array())
            m.indexer_types = get<std::vector<std::string>>(j, "indexer_types", path);
    }
    // Several next-n layers are distinct MTP layers, one per depth (DeepSeek-V3's layout).
    m.mtp_num_layers = get_or<int64_t>(j, "num_nextn_predict_layers", 0, path);
    m.mtp_use_repeated_layer = m.mtp_num_layers <= 1;
    if (!m.mtp_use_repeated_layer) m.dsa_mtp_index_kv_share = false;
    return m;
}

ModelConfig load_hf_config(const std::string& path) {
    std::ifstream in(path);
    ST_CHECK(in.good(), "cannot read '", path, "'");
    std::stringstream ss;
    ss << in.rdbuf();
    return parse_hf_config(ss.str(), path);
}

}  // namespace sparsetron
