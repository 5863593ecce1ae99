// Recipe::validate: every combination check, each naming the key(s) and what was expected.
#include <set>

#include "sparsetron/config/implied_sizes.h"
#include "sparsetron/config/key_ranges.h"
#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/config/recipe.h"
#include "sparsetron/core/error.h"
#include "sparsetron/data/split.h"

namespace sparsetron {
namespace {

void positive(int64_t v, const char* key) {
    ST_CHECK(v > 0, "recipe key '", key, "' must be > 0, got ", v);
}

void one_of(const std::string& v, const char* key, const std::set<std::string>& allowed) {
    if (allowed.count(v)) return;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + (a.empty() ? "\"\"" : a);
    throw Error(cat("recipe key '", key, "' is \"", v, "\"; expected one of: ", list));
}

}  // namespace

void Recipe::validate() {
    ModelConfig& m = model;
    RunConfig& r = run;
    // Ranges first: the checks below divide by sizes and multiply them.
    check_key_ranges(*this);
    positive(m.num_layers, "num_layers");
    positive(m.hidden_size, "hidden_size");
    positive(m.vocab_size, "vocab_size");
    positive(m.num_attention_heads, "num_attention_heads");
    positive(m.q_lora_rank, "q_lora_rank");
    positive(m.kv_lora_rank, "kv_lora_rank");
    positive(m.qk_head_dim, "qk_head_dim");
    positive(m.qk_pos_emb_head_dim, "qk_pos_emb_head_dim");
    positive(m.v_head_dim, "v_head_dim");
    ST_CHECK(m.qk_pos_emb_head_dim % 2 == 0,
             "recipe key 'qk_pos_emb_head_dim' must be even (RoPE "
             "rotates pairs), got ",
             m.qk_pos_emb_head_dim);
    ST_CHECK(m.rotary_base > 1.0, "recipe key 'rotary_base' must be > 1, got ", m.rotary_base);
    ST_CHECK(m.norm_epsilon > 0 && m.latent_norm_epsilon > 0, "norm epsilons must be > 0");
    ST_CHECK(m.init_method_std > 0, "recipe key 'init_method_std' must be > 0");
    ST_CHECK(m.untie_embeddings_and_output_weights,
             "recipe key 'untie_embeddings_and_output_weights' must be true: GLM-5 has separate "
             "embedding and output head (SPEC §1)");

    m.moe_layer_pattern = parse_moe_layer_freq(m.moe_layer_freq, m.num_layers);
    if (m.num_dense_layers() > 0) positive(m.ffn_hidden_size, "ffn_hidden_size");
    if (m.num_moe_layers() > 0) {
        positive(m.num_experts, "num_experts");
        positive(m.moe_ffn_hidden_size, "moe_ffn_hidden_size");
        ST_CHECK(m.moe_router_topk >= 1 && m.moe_router_topk <= m.num_experts,
                 "recipe key 'moe_router_topk' must be in [1, num_experts=", m.num_experts,
                 "], got ", m.moe_router_topk);
        ST_CHECK(m.num_experts % r.expert_model_parallel_size == 0, "num_experts (", m.num_experts,
                 ") must be divisible by expert_model_parallel_size (",
                 r.expert_model_parallel_size, ")");
        ST_CHECK(m.moe_capacity_factor >= 0, "recipe key 'moe_capacity_factor' must be >= 0");
        positive(m.moe_paged_stash_page_size, "moe_paged_stash_page_size");
        ST_CHECK(m.moe_paged_stash_buffer_size_factor_cuda > 0,
                 "recipe key 'moe_paged_stash_buffer_size_factor_cuda' must be > 0, got ",
                 m.moe_paged_stash_buffer_size_factor_cuda);
        ST_CHECK(m.moe_expert_rank_capacity_factor >= 0,
                 "recipe key 'moe_expert_rank_capacity_factor' must be >= 0, got ",
                 m.moe_expert_rank_capacity_factor);
        // Token dropping keeps the first rows of each expert of the whole micro-batch: the
        // budget's redo in token chunks would keep others.
        ST_CHECK(m.moe_expert_rank_capacity_factor == 0 || m.moe_capacity_factor == 0,
                 "moe_expert_rank_capacity_factor (a receive budget with a dropless redo) and "
                 "moe_capacity_factor (token dropping) exclude each other; set one to 0");
    }

    one_of(m.experimental_attention_variant, "experimental_attention_variant", {"none", "dsa"});
    ST_CHECK(m.recompute_granularity != "full",
             "recompute_granularity: full (whole-layer recompute) is not implemented; use "
             "recompute_granularity: selective with recompute_modules from ",
             [] {
                 std::string s;
                 for (const auto& n : recompute_module_names()) s += (s.empty() ? "" : ", ") + n;
                 return s;
             }());
    one_of(m.recompute_granularity, "recompute_granularity", {"", "null", "none", "selective"});
    positive(m.recompute_block_rows, "recompute_block_rows");
    m.activation();  // throws, naming the key, for unknown or conflicting module names
    for (const auto& mod :
         m.fine_grained_activation_offloading ? m.offload_modules : std::vector<std::string>{}) {
        ST_CHECK(!m.moe_paged_stash ||
                     (mod != "expert_fc1" && mod != "moe_act" && mod != "fused_group_mlp"),
                 "offload_modules names ", mod,
                 ", whose activations moe_paged_stash already keeps in its pages; drop one");
        // As Megatron's paged stash: the budget's redo rewrites the expert rows in chunks.
        ST_CHECK(m.moe_expert_rank_capacity_factor == 0 ||
                     (mod != "expert_fc1" && mod != "moe_act" && mod != "fused_group_mlp"),
                 "offload_modules names ", mod,
                 ", which moe_expert_rank_capacity_factor does not combine with (its redo "
                 "recomputes the expert rows in chunks); drop one");
    }
    // Megatron's DSA backends (none, tilelang, cudnn) each name a kernel library; the engine
    // runs its own kernels for any of them (docs/cuda.md), so each is accepted and nothing else.
    one_of(m.dsa_kernel_backend, "dsa_kernel_backend", {"auto", "none", "tilelang", "cudnn"});
    ST_CHECK(m.dsa_saved_probs_max_mib >= 0,
             "recipe key 'dsa_saved_probs_max_mib' must be >= 0, got ", m.dsa_saved_probs_max_mib);
    if (m.uses_dsa()) {
        positive(m.dsa_indexer_n_heads, "dsa_indexer_n_heads");
        positive(m.dsa_indexer_query_block, "dsa_indexer_query_block");
        positive(m.dsa_indexer_head_dim, "dsa_indexer_head_dim");
        ST_CHECK(m.dsa_indexer_topk > 0, "recipe key 'dsa_indexer_topk' must be > 0, got ",
                 m.dsa_indexer_topk);
        positive(m.dsa_indexer_topk_freq, "dsa_indexer_topk_freq");
        ST_CHECK(m.dsa_indexer_skip_topk_offset >= 0,
                 "recipe key 'dsa_indexer_skip_topk_offset' must be >= 0");
        ST_CHECK(m.dsa_indexer_head_dim >= m.qk_pos_emb_head_dim,
                 "dsa_indexer_head_dim must be >= qk_pos_emb_head_dim (RoPE on its first dims)");
        ST_CHECK(m.dsa_indexer_loss_coeff >= 0, "recipe key 'dsa_indexer_loss_coeff' must be >= 0");
        for (const auto& t : m.indexer_types) one_of(t, "indexer_types", {"full", "shared"});
        if (!m.indexer_types.empty())
            ST_CHECK(static_cast<int64_t>(m.indexer_types.size()) >= m.num_layers,
                     "recipe key 'indexer_types' lists ", m.indexer_types.size(),
                     " layers; num_layers is ", m.num_layers);
    }
    ST_CHECK(m.mtp_num_layers >= 0, "recipe key 'mtp_num_layers' must be >= 0");
    if (m.uses_dsa() && m.mtp_num_layers > 1 && m.dsa_mtp_index_kv_share)
        ST_CHECK(m.mtp_use_repeated_layer,
                 "dsa_mtp_index_kv_share: true hands depth 1's latent keys and top-k to the later "
                 "depths of the one repeated MTP layer; with mtp_use_repeated_layer: false each "
                 "depth's own layer computes its keys: set dsa_mtp_index_kv_share: false");
    // dsa_mtp_index_kv_share on an MTP layer that IndexShare makes "shared" (the seed's 256-GPU
    // recipe: 78 layers, offset 2) is accepted, where Megatron and SPEC §5 refuse it: depth 1
    // attends over its source layer's top-k like any shared layer and computes the latent K' that
    // the later depths reuse; no depth runs an indexer (docs/model.md: MTP kv sharing on a
    // shared MTP layer).
    one_of(m.mtp_loss_type, "mtp_loss_type", {"cross_entropy", "e2e_tv"});
    if (m.mtp_num_layers > 0 && m.mtp_loss_type == "e2e_tv")
        ST_CHECK(m.mtp_detach_heads,
                 "mtp_loss_type: e2e_tv requires mtp_detach_heads: true (the TV target comes from "
                 "the main head, which must not receive the MTP gradient)");

    if (r.dsa_dense_warmup)
        ST_CHECK(m.uses_dsa() && m.dsa_indexer_loss_coeff > 0,
                 "dsa_dense_warmup trains the DSA indexer alone: it needs "
                 "experimental_attention_variant: dsa and dsa_indexer_loss_coeff > 0");
    positive(r.seq_length, "seq_length");
    ST_CHECK(r.seq_length >= 2, "recipe key 'seq_length' is ", r.seq_length,
             ": a sample needs at least 2 tokens (the loss predicts each token from the ones "
             "before it)");
    positive(r.micro_batch_size, "micro_batch_size");
    positive(r.global_batch_size, "global_batch_size");
    ST_CHECK(r.train_iters >= 1, "recipe key 'train_iters' is ", r.train_iters,
             ": a run trains at least one step (resuming a finished run: raise train_iters)");
    positive(r.log_interval, "log_interval");
    ST_CHECK(r.save_interval >= 0, "recipe key 'save_interval' must be >= 0");
    positive(r.save_keep_last, "save_keep_last");
    const std::array<double, 3> split = parse_split(r.split);  // names the key on a bad value
    ST_CHECK(split[0] > 0, "recipe key 'split': '", r.split,
             "' leaves no documents for training (the first weight is train)");
    ST_CHECK(r.eval_interval >= 0 && r.eval_iters >= 0,
             "recipe keys 'eval_interval' and 'eval_iters' must be >= 0 (0: no validation)");
    ST_CHECK(r.distributed_timeout_minutes >= 0,
             "recipe key 'distributed_timeout_minutes' must be >= 0 (0: no deadline)");
    ST_CHECK(r.exit_interval >= 0 && r.exit_duration_in_mins >= 0,
             "recipe keys 'exit_interval' and 'exit_duration_in_mins' must be >= 0 (0: never)");
    ST_CHECK(r.skipped_iters_limit >= 0,
             "recipe key 'skipped_iters_limit' must be >= 0 (0: no limit)");
    ST_CHECK(r.max_documents_per_microbatch >= 0, "max_documents_per_microbatch must be >= 0");
    ST_CHECK(r.max_seqlen_per_dp_cp_rank >= 0, "max_seqlen_per_dp_cp_rank must be >= 0");
    ST_CHECK(r.loss_chunk_rows >= 0, "recipe key 'loss_chunk_rows' must be >= 0");

    one_of(r.optimizer, "optimizer", {"adam", "adamw", "muon"});
    ST_CHECK(r.lr >= 0 && r.min_lr >= 0 && r.min_lr <= r.lr, "need 0 <= min_lr (", r.min_lr,
             ") <= lr (", r.lr, ")");
    ST_CHECK(r.adam_beta1 >= 0 && r.adam_beta1 < 1, "adam_beta1 must be in [0, 1)");
    ST_CHECK(r.adam_beta2 >= 0 && r.adam_beta2 < 1, "adam_beta2 must be in [0, 1)");
    ST_CHECK(r.adam_eps > 0, "adam_eps must be > 0");
    ST_CHECK(r.weight_decay >= 0, "weight_decay must be >= 0");
    ST_CHECK(r.clip_grad >= 0, "clip_grad must be >= 0 (0 disables clipping)");
    ST_CHECK(r.lr_warmup_iters >= 0 && r.lr_decay_iters >= 0, "lr iteration counts must be >= 0");
    one_of(r.lr_decay_style, "lr_decay_style",
           {"cosine", "constant", "linear", "WSD", "inverse-square-root"});
    one_of(r.lr_wsd_decay_style, "lr_wsd_decay_style",
           {"exponential", "linear", "cosine", "minus_sqrt"});
    // As Megatron's scheduler asserts (but a warm-up longer than the run, which short runs of
    // a recipe meet: the rate then only warms up).
    const int64_t decay_iters = r.lr_decay_iters > 0 ? r.lr_decay_iters : r.train_iters;
    ST_CHECK(r.lr_warmup_init <= r.lr, "lr_warmup_init (", r.lr_warmup_init, ") <= lr (", r.lr,
             ")");
    ST_CHECK(r.lr_decay_style != "WSD" ||
                 (r.lr_wsd_decay_iters > 0 && r.lr_wsd_decay_iters <= decay_iters),
             "lr_decay_style: WSD needs lr_wsd_decay_iters, the anneal's iterations at the end "
             "of lr_decay_iters (",
             decay_iters, "), in (0, ", decay_iters, "]");
    one_of(r.muon_scale_mode, "muon_scale_mode", {"spectral", "shape_scaling", "unit_rms_norm"});
    one_of(r.muon_coefficient_type, "muon_coefficient_type", {"quintic", "simple"});
    positive(r.muon_num_ns_steps, "muon_num_ns_steps");
    one_of(r.muon_fp32_matmul_prec, "muon_fp32_matmul_prec", {"low", "medium", "high", "highest"});
    one_of(r.muon_ns_method, "muon_ns_method", {"standard", "gram"});
    ST_CHECK(r.muon_extra_scale_factor > 0, "muon_extra_scale_factor must be > 0");
    ST_CHECK(r.muon_momentum >= 0 && r.muon_momentum < 1, "muon_momentum must be in [0, 1)");

    positive(r.tensor_model_parallel_size, "tensor_model_parallel_size");
    positive(r.pipeline_model_parallel_size, "pipeline_model_parallel_size");
    positive(r.expert_model_parallel_size, "expert_model_parallel_size");
    positive(r.context_parallel_size, "context_parallel_size");
    positive(r.world_size, "world_size");
    ST_CHECK(m.num_attention_heads % r.tensor_model_parallel_size == 0, "num_attention_heads (",
             m.num_attention_heads, ") must be divisible by tensor_model_parallel_size (",
             r.tensor_model_parallel_size, ")");
    int64_t model_parallel =
        r.tensor_model_parallel_size * r.pipeline_model_parallel_size * r.context_parallel_size;
    ST_CHECK(r.world_size % model_parallel == 0, "world_size (", r.world_size,
             ") must be divisible by tensor x pipeline x context parallel sizes (", model_parallel,
             ")");
    ST_CHECK((r.world_size / r.pipeline_model_parallel_size) % r.expert_model_parallel_size == 0,
             "expert_model_parallel_size (", r.expert_model_parallel_size,
             ") must divide world_size / pipeline_model_parallel_size (",
             r.world_size / r.pipeline_model_parallel_size, ")");
    int64_t per_step = r.micro_batch_size * r.data_parallel_size();
    ST_CHECK(r.global_batch_size % per_step == 0, "global_batch_size (", r.global_batch_size,
             ") must be divisible by micro_batch_size x data-parallel size (", per_step, ")");
    check_index_share_pipeline_split(m, pipeline_stage_layers(m, r));
    if (pipeline_virtual_stages(m, r) > 1) {
        // Megatron's interleaved schedule takes micro-batches in groups of P (under dynamic CP
        // each rank's step is padded with empty micro-batches to such a multiple).
        ST_CHECK(r.microbatches_per_step() % r.pipeline_model_parallel_size == 0,
                 "interleaved virtual pipeline stages need the micro-batches per step (",
                 r.microbatches_per_step(), ") to be a multiple of pipeline_model_parallel_size (",
                 r.pipeline_model_parallel_size, ")");
    }
    check_implied_sizes(m, r);
    one_of(r.sequence_packing_scheduler, "sequence_packing_scheduler",
           {"default", "default_dynamic_cp"});
    ST_CHECK(!r.dynamic_context_parallel || r.calculate_per_token_loss,
             "dynamic_context_parallel needs calculate_per_token_loss: true (as Megatron requires: "
             "a micro-batch's mean would depend on how its documents were grouped)");
    one_of(r.fp8_recipe, "fp8_recipe", {"", "blockwise", "mxfp8", "tensorwise"});
    ST_CHECK(!m.fp8_output_proj || r.fp8_recipe == "blockwise" || r.fp8_recipe == "mxfp8",
             "fp8_output_proj runs the output head under the FP8 recipe: it needs fp8_recipe "
             "(blockwise on Hopper)");
    ST_CHECK(!r.fp8_param_gather || r.use_distributed_optimizer,
             "fp8_param_gather needs use_distributed_optimizer: true (as in Megatron: the FP8 "
             "weights are gathered from the ranks that own their masters)");
    ST_CHECK(r.use_varlen_dataset,
             "use_varlen_dataset: false (fixed-length samples) is not implemented: the engine "
             "always packs whole documents into THD micro-batches; set it true");
    one_of(r.fp8_format, "fp8_format", {"e4m3", "hybrid"});
    one_of(r.cuda_graph_impl, "cuda_graph_impl", {"none", "local", "full_iteration"});
    // Megatron's older key, migrated as Megatron migrates it.
    one_of(r.cuda_graph_scope, "cuda_graph_scope", {"", "full", "full_iteration"});
    if (r.cuda_graph_scope == "full_iteration") {
        ST_CHECK(r.cuda_graph_impl != "local",
                 "cuda_graph_scope: full_iteration (Megatron's older key) contradicts "
                 "cuda_graph_impl: local; use cuda_graph_impl: full_iteration alone");
        r.cuda_graph_impl = "full_iteration";
    }
    ST_CHECK(r.cuda_graph_modules.empty(),
             "cuda_graph_modules (Megatron's per-module graph scopes) is not built: "
             "cuda_graph_impl: local captures whole layers; leave it empty");
    one_of(r.moe_expert_exchange, "moe_expert_exchange", {"auto", "nvlink", "nccl"});
}

}  // namespace sparsetron
