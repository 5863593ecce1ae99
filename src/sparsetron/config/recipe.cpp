#include "sparsetron/config/recipe.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

enum class Kind { Int, Float, Bool, String, StringList };

struct KeyDef {
    const char* name;
    Kind kind;
    void* (*field)(Recipe&);
};

#define MODEL_KEY(name, kind)                                                \
    {                                                                        \
#name, Kind::kind, [](Recipe & r) -> void* { return &r.model.name; } \
    }
#define RUN_KEY(name, kind)                                                \
    {                                                                      \
#name, Kind::kind, [](Recipe & r) -> void* { return &r.run.name; } \
    }

const std::vector<KeyDef>& key_table() {
    static const std::vector<KeyDef> table = {
        MODEL_KEY(num_layers, Int),
        MODEL_KEY(hidden_size, Int),
        MODEL_KEY(vocab_size, Int),
        MODEL_KEY(ffn_hidden_size, Int),
        MODEL_KEY(norm_epsilon, Float),
        MODEL_KEY(latent_norm_epsilon, Float),
        MODEL_KEY(init_method_std, Float),
        MODEL_KEY(num_attention_heads, Int),
        MODEL_KEY(q_lora_rank, Int),
        MODEL_KEY(kv_lora_rank, Int),
        MODEL_KEY(qk_head_dim, Int),
        MODEL_KEY(qk_pos_emb_head_dim, Int),
        MODEL_KEY(v_head_dim, Int),
        MODEL_KEY(kv_channels, Int),
        MODEL_KEY(rotary_base, Float),
        MODEL_KEY(rotary_interleaved, Bool),
        MODEL_KEY(moe_layer_freq, String),
        MODEL_KEY(num_experts, Int),
        MODEL_KEY(moe_ffn_hidden_size, Int),
        MODEL_KEY(moe_shared_expert_intermediate_size, Int),
        MODEL_KEY(moe_router_topk, Int),
        MODEL_KEY(moe_router_topk_scaling_factor, Float),
        MODEL_KEY(moe_router_bias_update_rate, Float),
        MODEL_KEY(moe_aux_loss_coeff, Float),
        MODEL_KEY(moe_router_force_load_balancing, Bool),
        MODEL_KEY(moe_capacity_factor, Float),
        MODEL_KEY(dsa_saved_probs_max_mib, Int),
        MODEL_KEY(dsa_indexer_query_block, Int),
        MODEL_KEY(moe_paged_stash, Bool),
        MODEL_KEY(recompute_granularity, String),
        MODEL_KEY(recompute_modules, StringList),
        MODEL_KEY(recompute_block_rows, Int),
        MODEL_KEY(fine_grained_activation_offloading, Bool),
        MODEL_KEY(offload_modules, StringList),
        MODEL_KEY(moe_paged_stash_page_size, Int),
        MODEL_KEY(moe_paged_stash_buffer_size_factor_cuda, Float),
        MODEL_KEY(moe_expert_rank_capacity_factor, Float),
        MODEL_KEY(experimental_attention_variant, String),
        MODEL_KEY(dsa_kernel_backend, String),
        MODEL_KEY(dsa_indexer_n_heads, Int),
        MODEL_KEY(dsa_indexer_head_dim, Int),
        MODEL_KEY(dsa_indexer_topk, Int),
        MODEL_KEY(dsa_indexer_topk_freq, Int),
        MODEL_KEY(dsa_indexer_skip_topk_offset, Int),
        MODEL_KEY(dsa_indexer_loss_coeff, Float),
        MODEL_KEY(dsa_indexer_use_sparse_loss, Bool),
        MODEL_KEY(dsa_indexer_rope_interleaved, Bool),
        MODEL_KEY(indexer_types, StringList),
        MODEL_KEY(mtp_num_layers, Int),
        MODEL_KEY(mtp_use_repeated_layer, Bool),
        MODEL_KEY(dsa_mtp_index_kv_share, Bool),
        MODEL_KEY(mtp_loss_type, String),
        MODEL_KEY(mtp_detach_heads, Bool),
        MODEL_KEY(fp8_output_proj, Bool),
        MODEL_KEY(mtp_loss_scaling_factor, Float),
        MODEL_KEY(untie_embeddings_and_output_weights, Bool),
        RUN_KEY(data_path, StringList),
        RUN_KEY(split, String),
        RUN_KEY(eval_interval, Int),
        RUN_KEY(eval_iters, Int),
        RUN_KEY(tensorboard_dir, String),
        RUN_KEY(seq_length, Int),
        RUN_KEY(micro_batch_size, Int),
        RUN_KEY(global_batch_size, Int),
        RUN_KEY(max_seqlen_per_dp_cp_rank, Int),
        RUN_KEY(max_documents_per_microbatch, Int),
        RUN_KEY(use_varlen_dataset, Bool),
        RUN_KEY(train_iters, Int),
        RUN_KEY(seed, Int),
        RUN_KEY(log_interval, Int),
        RUN_KEY(save, String),
        RUN_KEY(save_interval, Int),
        RUN_KEY(save_keep_last, Int),
        RUN_KEY(skipped_iters_limit, Int),
        RUN_KEY(exit_signal_handler, Bool),
        RUN_KEY(distributed_timeout_minutes, Float),
        RUN_KEY(exit_interval, Int),
        RUN_KEY(exit_duration_in_mins, Float),
        RUN_KEY(load, String),
        RUN_KEY(pretrained_checkpoint, String),
        RUN_KEY(finetune, Bool),
        RUN_KEY(optimizer, String),
        RUN_KEY(lr, Float),
        RUN_KEY(min_lr, Float),
        RUN_KEY(weight_decay, Float),
        RUN_KEY(adam_beta1, Float),
        RUN_KEY(adam_beta2, Float),
        RUN_KEY(adam_eps, Float),
        RUN_KEY(clip_grad, Float),
        RUN_KEY(lr_warmup_iters, Int),
        RUN_KEY(lr_decay_style, String),
        RUN_KEY(lr_decay_iters, Int),
        RUN_KEY(lr_warmup_init, Float),
        RUN_KEY(lr_wsd_decay_iters, Int),
        RUN_KEY(lr_wsd_decay_style, String),
        RUN_KEY(muon_momentum, Float),
        RUN_KEY(muon_nesterov, Bool),
        RUN_KEY(muon_split_qkv, Bool),
        RUN_KEY(muon_split_qkv_per_head, Bool),
        RUN_KEY(muon_scale_mode, String),
        RUN_KEY(muon_extra_scale_factor, Float),
        RUN_KEY(muon_coefficient_type, String),
        RUN_KEY(muon_num_ns_steps, Int),
        RUN_KEY(muon_fp32_matmul_prec, String),
        RUN_KEY(muon_ns_method, String),
        RUN_KEY(tensor_model_parallel_size, Int),
        RUN_KEY(pipeline_model_parallel_size, Int),
        RUN_KEY(decoder_first_pipeline_num_layers, Int),
        RUN_KEY(decoder_last_pipeline_num_layers, Int),
        RUN_KEY(pipeline_model_parallel_layout, String),
        RUN_KEY(num_virtual_stages_per_pipeline_rank, Int),
        RUN_KEY(num_layers_per_virtual_pipeline_stage, Int),
        RUN_KEY(expert_model_parallel_size, Int),
        RUN_KEY(context_parallel_size, Int),
        RUN_KEY(dynamic_context_parallel, Bool),
        RUN_KEY(calculate_per_token_loss, Bool),
        RUN_KEY(use_distributed_optimizer, Bool),
        RUN_KEY(accumulate_allreduce_grads_in_fp32, Bool),
        RUN_KEY(grad_reduce_in_bf16, Bool),
        RUN_KEY(optimizer_cpu_offload, Bool),
        RUN_KEY(optimizer_offload_fraction, Float),
        RUN_KEY(overlap_grad_reduce, Bool),
        RUN_KEY(moe_expert_exchange, String),
        RUN_KEY(sequence_packing_scheduler, String),
        RUN_KEY(world_size, Int),
        RUN_KEY(bf16, Bool),
        RUN_KEY(fp8_recipe, String),
        RUN_KEY(fp8_format, String),
        RUN_KEY(fp8_param_gather, Bool),
        RUN_KEY(reuse_grad_buf_for_mxfp8_param_ag, Bool),
        RUN_KEY(cuda_graph_impl, String),
        RUN_KEY(cuda_graph_warmup_steps, Int),
        RUN_KEY(cuda_graph_modules, StringList),
        RUN_KEY(cuda_graph_scope, String),
        RUN_KEY(loss_chunk_rows, Int),
        RUN_KEY(dsa_dense_warmup, Bool),
    };
    return table;
}

#undef MODEL_KEY
#undef RUN_KEY

size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        cur[0] = i;
        for (size_t j = 1; j <= b.size(); ++j)
            cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
        std::swap(prev, cur);
    }
    return prev[b.size()];
}

std::string where(const RawSetting& s) {
    return s.origin.empty() ? s.key : cat(s.origin, ": ", s.key);
}

int64_t parse_int(const RawSetting& s) {
    const std::string& v = s.scalar;
    size_t used = 0;
    long long x = 0;
    try {
        x = std::stoll(v, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used == 0 || used != v.size()) {
        // Accept integral floats written as 1e3 or 4096.0.
        char* end = nullptr;
        double d = std::strtod(v.c_str(), &end);
        if (!v.empty() && end && *end == '\0' && std::isfinite(d) && d == std::floor(d) &&
            std::fabs(d) < 9e15)
            return static_cast<int64_t>(d);
        throw Error(cat(where(s), ": expected an integer, got \"", v, "\""));
    }
    return x;
}

double parse_float(const RawSetting& s) {
    char* end = nullptr;
    double d = std::strtod(s.scalar.c_str(), &end);
    if (s.scalar.empty() || !end || *end != '\0')
        throw Error(cat(where(s), ": expected a number, got \"", s.scalar, "\""));
    return d;
}

bool parse_bool(const RawSetting& s) {
    std::string v = s.scalar;
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
    if (v == "true" || v == "1" || v == "yes" || v == "on") return true;
    if (v == "false" || v == "0" || v == "no" || v == "off") return false;
    throw Error(cat(where(s), ": expected true or false, got \"", s.scalar, "\""));
}

std::vector<std::string> split_ws(const std::string& s) {
    std::istringstream is(s);
    std::vector<std::string> out;
    for (std::string w; is >> w;) out.push_back(w);
    return out;
}

std::string format_double(double d) {
    std::ostringstream os;
    os << std::setprecision(17) << d;
    std::string s = os.str();
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
    return s;
}

std::string quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        out += c;
    }
    return out + "\"";
}

}  // namespace

std::vector<std::string> recipe_key_names() {
    std::vector<std::string> names;
    for (const auto& k : key_table()) names.push_back(k.name);
    return names;
}

// What to tell a user about an unknown key: the Megatron name of a common HuggingFace or
// PyTorch name, else the nearest key when it is near (a few edits for the key's length), else
// where the keys are listed.
std::string unknown_key_hint(const std::string& key) {
    static const std::map<std::string, std::string> synonyms = {
        {"learning_rate", "lr"},
        {"warmup_steps", "lr_warmup_iters"},
        {"lr_warmup_steps", "lr_warmup_iters"},
        {"max_steps", "train_iters"},
        {"num_train_steps", "train_iters"},
        {"train_steps", "train_iters"},
        {"batch_size", "global_batch_size"},
        {"seq_len", "seq_length"},
        {"max_seq_len", "seq_length"},
        {"max_seq_length", "seq_length"},
        {"num_hidden_layers", "num_layers"},
        {"n_routed_experts", "num_experts"},
        {"num_experts_per_tok", "moe_router_topk"},
        {"intermediate_size", "ffn_hidden_size"},
        {"moe_intermediate_size", "moe_ffn_hidden_size"},
        {"num_heads", "num_attention_heads"},
        {"max_grad_norm", "clip_grad"},
        {"rope_theta", "rotary_base"},
        {"rms_norm_eps", "norm_epsilon"},
        {"num_nextn_predict_layers", "mtp_num_layers"},
        {"index_topk", "dsa_indexer_topk"},
    };
    const auto syn = synonyms.find(key);
    if (syn != synonyms.end()) return cat("Megatron's name for it is '", syn->second, "'");
    std::string best;
    size_t best_d = std::numeric_limits<size_t>::max();
    for (const auto& k : key_table()) {
        size_t d = edit_distance(key, k.name);
        if (d < best_d) best_d = d, best = k.name;
    }
    if (best_d <= std::max<size_t>(2, key.size() / 4)) return cat("did you mean '", best, "'?");
    return "no key is close; `sparsetron keys` lists every key";
}

void Recipe::apply(const RawSetting& s) {
    auto it = std::find_if(key_table().begin(), key_table().end(),
                           [&](const KeyDef& k) { return s.key == k.name; });
    if (it == key_table().end())
        throw Error(cat(s.origin.empty() ? "" : s.origin + ": ", "unknown recipe key '", s.key,
                        "' (", unknown_key_hint(s.key), ")"));
    void* field = it->field(*this);
    if (s.is_list && it->kind == Kind::String) {  // e.g. moe_layer_freq: [0, 1, 1]
        std::string joined = "[";
        for (size_t i = 0; i < s.items.size(); ++i) joined += (i ? "," : "") + s.items[i];
        RawSetting as_scalar = s;
        as_scalar.is_list = false;
        as_scalar.scalar = joined + "]";
        return apply(as_scalar);
    }
    if (s.is_list && it->kind != Kind::StringList)
        throw Error(cat(where(s), ": expected a single value, got a list"));
    switch (it->kind) {
        case Kind::Int:
            *static_cast<int64_t*>(field) = parse_int(s);
            break;
        case Kind::Float:
            *static_cast<double*>(field) = parse_float(s);
            break;
        case Kind::Bool:
            *static_cast<bool*>(field) = parse_bool(s);
            break;
        case Kind::String:
            *static_cast<std::string*>(field) = s.scalar;
            break;
        case Kind::StringList:
            *static_cast<std::vector<std::string>*>(field) =
                s.is_list ? s.items : split_ws(s.scalar);
            break;
    }
    settings.push_back(s);
}

std::vector<NumericKeyValue> Recipe::numeric_values() const {
    Recipe& self = const_cast<Recipe&>(*this);  // fields are only read below
    std::vector<NumericKeyValue> out;
    for (const auto& k : key_table()) {
        NumericKeyValue v;
        v.key = k.name;
        if (k.kind == Kind::Int) {
            v.is_int = true;
            v.int_value = *static_cast<int64_t*>(k.field(self));
            v.value = double(v.int_value);
        } else if (k.kind == Kind::Float) {
            v.value = *static_cast<double*>(k.field(self));
        } else {
            continue;
        }
        out.push_back(v);
    }
    return out;
}

std::string Recipe::to_yaml() const {
    Recipe& self = const_cast<Recipe&>(*this);  // fields are only read below
    std::ostringstream os;
    for (const auto& k : key_table()) {
        void* f = k.field(self);
        os << k.name << ": ";
        switch (k.kind) {
            case Kind::Int:
                os << *static_cast<int64_t*>(f);
                break;
            case Kind::Float:
                os << format_double(*static_cast<double*>(f));
                break;
            case Kind::Bool:
                os << (*static_cast<bool*>(f) ? "true" : "false");
                break;
            case Kind::String:
                os << quote(*static_cast<std::string*>(f));
                break;
            case Kind::StringList: {
                const auto& v = *static_cast<std::vector<std::string>*>(f);
                os << "[";
                for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << quote(v[i]);
                os << "]";
                break;
            }
        }
        os << "\n";
    }
    return os.str();
}

RawSetting parse_override(const std::string& kv) {
    size_t eq = kv.find('=');
    ST_CHECK(eq != std::string::npos && eq > 0, "--set expects key=value, got \"", kv, "\"");
    RawSetting s;
    s.key = kv.substr(0, eq);
    s.origin = "--set";
    std::string v = kv.substr(eq + 1);
    if (v.size() >= 2 && v.front() == '[' && v.back() == ']') {
        s.is_list = true;
        std::string inner = v.substr(1, v.size() - 2);
        std::istringstream is(inner);
        for (std::string item; std::getline(is, item, ',');) {
            size_t b = item.find_first_not_of(" \t\"'"), e = item.find_last_not_of(" \t\"'");
            if (b != std::string::npos) s.items.push_back(item.substr(b, e - b + 1));
        }
    } else {
        s.scalar = v;
    }
    return s;
}

}  // namespace sparsetron

namespace sparsetron {
Recipe builtin_tiny_recipe() {
    Recipe r;
    // The tiny demo's optimizer settings (recipes/tiny.yaml); the defaults are Megatron's.
    r.run.weight_decay = 0.1;
    r.run.adam_beta2 = 0.95;
    r.run.min_lr = 3e-4;
    r.model.dsa_indexer_loss_coeff = 1e-2;
    r.model.dsa_indexer_use_sparse_loss = true;
    r.run.lr_warmup_iters = 20;
    r.run.lr_decay_style = "cosine";
    r.validate();
    return r;
}
}  // namespace sparsetron
