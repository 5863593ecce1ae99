// The engine's part of a run's setup: the data it reads and the weights it starts from (the
// recipe's resolution, which reads YAML, is in run_resolve.cpp).
#include "sparsetron/runtime/run_setup.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <set>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"
#include "sparsetron/data/byte_tokenizer.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/model/param_table.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

fs::path find_bundled_corpus() {
    std::vector<fs::path> candidates;
    if (const auto env = env_value("SPARSETRON_DATA_DIR")) candidates.emplace_back(*env);
    candidates.emplace_back(fs::path(SPARSETRON_SOURCE_DIR) / "data" / "corpus");
    candidates.emplace_back(fs::path("data") / "corpus");
    for (const auto& c : candidates)
        if (fs::is_directory(c)) return c;
    throw Error(cat("data_path is empty and the bundled corpus was not found (looked in ",
                    candidates[1].string(), " and ./data/corpus; set SPARSETRON_DATA_DIR)"));
}

}  // namespace

std::string pretrained_weights_dir(const RunConfig& run, const std::string& resume_dir) {
    auto weights_dir = [](const std::string& d) {
        return is_model_dir(d) ? d : resolve_checkpoint(d);
    };
    const std::string load = resume_dir.empty() ? run.load : resume_dir;
    if (!run.pretrained_checkpoint.empty() && load.empty())
        return weights_dir(run.pretrained_checkpoint);
    if (load.empty()) return "";
    if (run.finetune) return weights_dir(load);
    // An HF directory has no training state: its weights start a fresh run.
    if (is_model_dir(load) && !fs::exists(fs::path(load) / "trainer_state.json")) return load;
    return "";
}

void check_pretrained_config(const std::string& dir, const ModelConfig& model) {
    const fs::path config = fs::path(dir) / "config.json";
    if (!fs::exists(config)) return;  // an engine checkpoint's tensors are checked by shape
    const ModelConfig hf = load_hf_config(config.string());
    const std::pair<const char*, std::pair<int64_t, int64_t>> dims[] = {
        {"num_layers", {model.num_layers, hf.num_layers}},
        {"hidden_size", {model.hidden_size, hf.hidden_size}},
        {"num_attention_heads", {model.num_attention_heads, hf.num_attention_heads}},
        {"vocab_size", {model.vocab_size, hf.vocab_size}},
        {"q_lora_rank", {model.q_lora_rank, hf.q_lora_rank}},
        {"kv_lora_rank", {model.kv_lora_rank, hf.kv_lora_rank}},
        {"qk_head_dim", {model.qk_head_dim, hf.qk_head_dim}},
        {"qk_pos_emb_head_dim", {model.qk_pos_emb_head_dim, hf.qk_pos_emb_head_dim}},
        {"v_head_dim", {model.v_head_dim, hf.v_head_dim}},
        {"ffn_hidden_size", {model.ffn_hidden_size, hf.ffn_hidden_size}},
        {"num_experts", {model.num_experts, hf.num_experts}},
        {"moe_ffn_hidden_size", {model.moe_ffn_hidden_size, hf.moe_ffn_hidden_size}},
    };
    for (const auto& [key, v] : dims)
        ST_CHECK(v.first == v.second, config.string(), " has ", key, " ", v.second,
                 " but the recipe has ", v.first,
                 ": train from it with the recipe's value set to the checkpoint's (or without "
                 "--recipe: the model dimensions then come from config.json)");
    // More trained MTP layers than the recipe has would be dropped without a word.
    ST_CHECK(model.mtp_physical_layers() >= hf.mtp_physical_layers(), config.string(), " has ",
             hf.mtp_physical_layers(),
             " distinct MTP layers (num_nextn_predict_layers) but the "
             "recipe trains ",
             model.mtp_physical_layers(),
             ": set mtp_use_repeated_layer: false and mtp_num_layers: ", hf.mtp_num_layers,
             " (or more) to keep them");
}

void check_checkpoint_weights_kept(const std::string& ckpt_dir, const ModelConfig& model) {
    ModelConfig whole = model;  // every rank's experts, every stage's layers
    whole.expert_parallel_ranks = 1, whole.expert_parallel_rank = 0;
    MemoryPlan names_only;
    const std::unique_ptr<ParamStore> table = make_param_table(whole, names_only, DType::F32);
    std::set<std::string> held;
    for (const auto& p : table->params()) held.insert(p.name);
    std::vector<std::string> dropped;
    for (const auto& [name, file] : tensor_files(ckpt_dir, "model"))
        if (!held.count(name)) dropped.push_back(name);
    if (dropped.empty()) return;
    throw Error(cat(ckpt_dir, " holds ", dropped.size(),
                    " trained tensors that this recipe's model ", "has no parameter for (",
                    dropped.front(), dropped.size() > 1 ? ", ..." : "",
                    "): resuming would drop them. Keep the checkpoint's model keys (",
                    "mtp_num_layers, experimental_attention_variant, num_layers), or start a new ",
                    "run from its weights with --set finetune=true"));
}

std::vector<std::string> resolve_data_path(const RunConfig& run, const std::string& out_dir) {
    if (!run.data_path.empty()) return run.data_path;
    fs::path corpus = find_bundled_corpus();
    std::vector<std::string> inputs;
    for (const auto& e : fs::directory_iterator(corpus))
        if (e.path().extension() == ".txt") inputs.push_back(e.path().string());
    std::sort(inputs.begin(), inputs.end());
    ST_CHECK(!inputs.empty(), "the bundled corpus ", corpus.string(), " holds no .txt files");
    fs::path dir = fs::path(out_dir) / "data";
    ensure_writable_dir(dir.string());
    std::string prefix = (dir / "corpus").string();
    if (!fs::exists(prefix + ".idx") || !fs::exists(prefix + ".bin")) {
        PreprocessOptions o;
        o.inputs = inputs;
        o.output_prefix = prefix;
        preprocess(o);
    }
    return {prefix};
}

}  // namespace sparsetron
