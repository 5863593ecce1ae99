#include "sparsetron/config/key_ranges.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

constexpr double kDim = double(1 << 20);             // a width: hidden, FFN, ranks, head dims
constexpr double kCount = double(int64_t(1) << 40);  // iterations, intervals, step counts
constexpr double kSize = double(1 << 24);            // tokens, rows, vocabulary, batch sizes
constexpr double kRanks = double(1 << 20);           // parallel sizes
constexpr double kInt64 = double(std::numeric_limits<int64_t>::max());

std::string bound(double v) {
    if (v == std::floor(v) && std::fabs(v) < 1e18) return std::to_string(int64_t(v));
    return cat(v);
}

}  // namespace

const std::vector<KeyRange>& key_ranges() {
    static const std::vector<KeyRange> ranges = {
        {"num_layers", 1, 4096},
        {"hidden_size", 1, kDim},
        {"vocab_size", 1, kSize},
        {"ffn_hidden_size", 0, kDim},
        {"norm_epsilon", 0, 1, true},
        {"latent_norm_epsilon", 0, 1, true},
        {"init_method_std", 0, 1, true},
        {"num_attention_heads", 1, 4096},
        {"q_lora_rank", 1, kDim},
        {"kv_lora_rank", 1, kDim},
        {"qk_head_dim", 1, 65536},
        {"qk_pos_emb_head_dim", 1, 65536},
        {"v_head_dim", 1, 65536},
        {"kv_channels", 0, 65536},
        {"rotary_base", 1, 1e15, true},
        {"num_experts", 0, 65536},
        {"moe_ffn_hidden_size", 0, kDim},
        {"moe_shared_expert_intermediate_size", 0, kDim},
        {"moe_router_topk", 1, 65536},
        {"moe_router_topk_scaling_factor", 0, 1e6, true},
        {"moe_router_bias_update_rate", 0, 1},
        {"moe_aux_loss_coeff", 0, 1e6},
        {"moe_capacity_factor", 0, 1e6},
        {"dsa_saved_probs_max_mib", 0, double(1 << 30)},
        {"dsa_indexer_query_block", 1, kSize},
        {"recompute_block_rows", 1, kSize},
        {"moe_paged_stash_page_size", 1, kSize},
        {"moe_paged_stash_buffer_size_factor_cuda", 0, 1024, true},
        {"moe_expert_rank_capacity_factor", 0, 1024},
        {"optimizer_offload_fraction", 0, 1},
        {"dsa_indexer_n_heads", 1, 4096},
        {"dsa_indexer_head_dim", 1, 65536},
        {"dsa_indexer_topk", 1, kSize},
        {"dsa_indexer_topk_freq", 1, 4096},
        {"dsa_indexer_skip_topk_offset", 0, 4096},
        {"dsa_indexer_loss_coeff", 0, 1e6},
        {"mtp_num_layers", 0, 64},
        {"mtp_loss_scaling_factor", 0, 1e6},
        {"eval_interval", 0, kCount},
        {"eval_iters", 0, kCount},
        {"seq_length", 2, kSize, false, false,
         "a sample needs at least 2 tokens (the loss predicts each token from the ones before "
         "it)"},
        {"micro_batch_size", 1, 65536},
        {"global_batch_size", 1, kSize},
        {"max_seqlen_per_dp_cp_rank", 0, kSize},
        {"max_documents_per_microbatch", 0, kSize},
        {"train_iters", 1, kCount, false, false,
         "a run trains at least one step (resuming a finished run: raise train_iters)"},
        {"seed", 0, kInt64},
        {"log_interval", 1, kCount},
        {"cuda_graph_warmup_steps", 1, kCount},
        {"save_interval", 0, kCount},
        {"save_keep_last", 1, double(1 << 20)},
        {"skipped_iters_limit", 0, kCount},
        {"distributed_timeout_minutes", 0, 1e6},
        {"exit_interval", 0, kCount},
        {"exit_duration_in_mins", 0, 1e9},
        // Any rate whose products with fp32 updates stay finite (a diverging lr is the run's
        // business: its skipped steps stop it, naming the checkpoint to resume from).
        {"lr", 0, 1e30},
        {"min_lr", 0, 1e30},
        {"weight_decay", 0, 100},
        {"adam_beta1", 0, 1, false, true},
        {"adam_beta2", 0, 1, false, true},
        {"adam_eps", 0, 1, true},
        {"clip_grad", 0, 1e12},
        {"lr_warmup_iters", 0, kCount},
        {"lr_decay_iters", 0, kCount},
        {"lr_wsd_decay_iters", 0, kCount},
        {"lr_warmup_init", 0, 1e3},
        {"muon_momentum", 0, 1, false, true},
        {"muon_extra_scale_factor", 0, 1e6, true},
        {"muon_num_ns_steps", 1, 100},
        {"tensor_model_parallel_size", 1, kRanks},
        {"pipeline_model_parallel_size", 1, kRanks},
        {"decoder_first_pipeline_num_layers", 0, 4096},
        {"num_virtual_stages_per_pipeline_rank", 0, 4096},
        {"num_layers_per_virtual_pipeline_stage", 0, 4096},
        {"decoder_last_pipeline_num_layers", 0, 4096},
        {"expert_model_parallel_size", 1, kRanks},
        {"context_parallel_size", 1, kRanks},
        {"world_size", 1, kRanks},
        {"loss_chunk_rows", 0, kSize},
    };
    return ranges;
}

void check_key_ranges(const Recipe& recipe) {
    for (const NumericKeyValue& v : recipe.numeric_values()) {
        const KeyRange* range = nullptr;
        for (const KeyRange& r : key_ranges())
            if (v.key == r.key) range = &r;
        ST_CHECK(range, "recipe key '", v.key, "' has no range (config/key_ranges.cpp)");
        const std::string text = v.is_int ? std::to_string(v.int_value) : cat(v.value);
        ST_CHECK(std::isfinite(v.value), "recipe key '", v.key, "' is ", text,
                 ": a finite number is needed");
        const bool low = range->lo_open ? v.value <= range->lo : v.value < range->lo;
        const bool high = range->hi_open ? v.value >= range->hi : v.value > range->hi;
        if (!low && !high) continue;
        if (low && range->why)
            throw Error(cat("recipe key '", v.key, "' is ", text, ": ", range->why));
        if (low && !high && range->lo == 0 && range->lo_open)
            throw Error(cat("recipe key '", v.key, "' must be > 0, got ", text));
        if (low && !high && range->lo == 1 && v.is_int)
            throw Error(cat("recipe key '", v.key, "' must be > 0, got ", text));
        if (low && !high && range->lo == 0)
            throw Error(cat("recipe key '", v.key, "' must be >= 0, got ", text));
        throw Error(cat("recipe key '", v.key, "' must be in ", range->lo_open ? "(" : "[",
                        bound(range->lo), ", ", bound(range->hi), range->hi_open ? ")" : "]",
                        ", got ", text));
    }
}

}  // namespace sparsetron
