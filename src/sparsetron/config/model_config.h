// The model's shape and architecture switches (SPEC §0). Field names follow Megatron's recipe keys;
// `hf_config.h` maps them to and from HuggingFace `glm_moe_dsa` config.json names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/config/activation_policy.h"

namespace sparsetron {

// Defaults are the built-in tiny recipe (recipes/tiny.yaml): the whole GLM-5.2 architecture at toy
// size, so the CPU demo and CI train DSA, IndexShare, MoE and repeated MTP.
struct ModelConfig {
    // Backbone.
    int64_t num_layers = 2;
    int64_t hidden_size = 128;
    int64_t vocab_size = 320;
    int64_t ffn_hidden_size = 352;
    double norm_epsilon = 1e-5;         // input/post-attention/final RMSNorm
    double latent_norm_epsilon = 1e-6;  // q_a / kv_a RMSNorm (HF default)
    double init_method_std = 0.02;

    // MLA attention.
    int64_t num_attention_heads = 4;
    int64_t q_lora_rank = 96;
    int64_t kv_lora_rank = 64;
    int64_t qk_head_dim = 32;          // the no-RoPE part (HF qk_nope_head_dim)
    int64_t qk_pos_emb_head_dim = 16;  // the RoPE part (HF qk_rope_head_dim)
    int64_t v_head_dim = 32;
    int64_t kv_channels = 0;  // accepted for Megatron compatibility; MLA derives its head sizes
    double rotary_base = 10000.0;
    bool rotary_interleaved = true;  // HF rope_interleave: pairs (2i, 2i+1); false: (i, i+d/2)

    // Dense/MoE pattern: moe_layer_pattern[l] = 1 for an MoE layer.
    std::string moe_layer_freq = "[0,1]";  // as written in the recipe; "" = all dense
    std::vector<int> moe_layer_pattern;
    int64_t num_experts = 4;
    int64_t moe_ffn_hidden_size = 96;
    int64_t moe_shared_expert_intermediate_size = 96;
    int64_t moe_router_topk = 2;
    double moe_router_topk_scaling_factor = 2.5;
    double moe_router_bias_update_rate = 1e-3;
    double moe_aux_loss_coeff = 0.0;
    bool moe_router_force_load_balancing = false;
    double moe_capacity_factor = 0.0;  // 0 = dropless bound (worst case)
    // CUDA: the masked sparse attention keeps a layer's forward probabilities (bf16) for its
    // backward, instead of recomputing scores and probabilities, when they fit in this many MiB
    // per layer (1.12 GiB at the proxy's 4096 tokens x 64 heads, for every layer and MTP depth);
    // 0 (default) = always recompute. A memory-for-speed trade the recipe opts into.
    int64_t dsa_saved_probs_max_mib = 0;
    // CUDA, no context parallelism: query rows the DSA indexer scores at once. A longer
    // micro-batch is scored, selected and (with the indexer loss) given its loss in blocks of
    // this many rows, so the indexer's fp32 scores and loss gradient are [block, tokens]; the
    // loss scores each block again after the attention. A micro-batch of at most this many rows
    // keeps its scores from the forward for the loss.
    int64_t dsa_indexer_query_block = 4096;
    // CUDA: selective recompute (Megatron's keys). With recompute_granularity "selective", the
    // outputs of the named modules are not kept per layer for the backward: one shared buffer
    // holds them and the backward recomputes them (the same kernels on the same inputs: the same
    // values). core_attn: the attention core's outputs (o', o); mla_up_proj: the query (and
    // expanded keys / values) up-projections and Q'; layernorm: the layer's two RMSNorm outputs;
    // moe_act: the routed experts' SwiGLU output; mlp / shared_experts: the dense MLP's / the
    // shared expert's gate and up outputs and SwiGLU. The CPU backend keeps every activation.
    std::string recompute_granularity;  // "" (none) | "selective"
    std::vector<std::string> recompute_modules = {"core_attn"};
    // CUDA: token rows per block of a recomputed module that runs its forward and backward a
    // block at a time, so its recomputed outputs and their gradients hold one block: the absorbed
    // attention over the gathered sparse kernels with core_attn and mla_up_proj (where no indexer
    // loss reads its whole Q'), the dense MLP (mlp) and the shared expert (shared_experts).
    int64_t recompute_block_rows = 16384;
    // CUDA: activation offload (Megatron's keys). With fine_grained_activation_offloading, the
    // named modules' saved activations of every layer application but the last two (backbone
    // layers, then MTP depths) wait for their backward in pinned host memory: copied out on a side
    // stream after the application's forward, back in while the next application's backward
    // runs (model/cuda/activation_offload.h). attn_norm / mlp_norm: the RMSNorm outputs;
    // qkv_linear: the query up-projection and Q' (expanded: per-head keys and values); core_attn:
    // o' and the kept probabilities; attn_proj: o, the output projection's input; expert_fc1: the
    // routed experts' input rows and gate / up outputs; moe_act: their SwiGLU output;
    // fused_group_mlp: all of the routed experts' (expert_fc1, moe_act and their output rows).
    bool fine_grained_activation_offloading = false;
    std::vector<std::string> offload_modules;
    // The four keys above as types (config/activation_policy.h); throws for what validation
    // refuses.
    ActivationPolicy activation() const;
    // CUDA: the MoE's saved activations in a shared page pool (model/cuda/moe_stash.h).
    bool moe_paged_stash = false;
    int64_t moe_paged_stash_page_size = 64;  // rows per page
    // The pool over every application's rows on balanced routing (Megatron's default).
    double moe_paged_stash_buffer_size_factor_cuda = 1.10;
    // CUDA expert parallelism: the rows one rank's experts receive in one MoE application are
    // bounded by this factor x tokens x top-k (Megatron's static receive budget; 0: the dropless
    // worst case), a 1/W share of it from each source rank. A step whose routing goes over it
    // on any rank is skipped on the device and run again eagerly, its MoE layers in token chunks
    // whose worst case fits (moe_ep_redo_chunk_tokens).
    double moe_expert_rank_capacity_factor = 0.0;
    // Not recipe keys: make_training_plan() copies the run's expert_model_parallel_size here
    // (the bound of the MoE layers' expert-parallel receive buffers) and the trainer this
    // process's rank in its EP group. With more than one EP rank the routed experts are sharded:
    // a rank's model holds (and trains) only experts [rank E/W, (rank + 1) E/W) of each layer.
    int64_t expert_parallel_ranks = 1;
    int64_t expert_parallel_rank = 0;
    // Set by the engine and `plan` (CpRowPlan::max_group): the largest CP group one micro-batch
    // runs over (context_parallel_size, or under dynamic CP a stage's DP x CP ranks). The CUDA
    // key exchange's buffers hold that many ranks' rows.
    int64_t context_parallel_ranks = 1;
    int64_t local_experts() const { return num_experts / expert_parallel_ranks; }
    int64_t first_local_expert() const { return expert_parallel_rank * local_experts(); }

    // DSA.
    std::string experimental_attention_variant = "dsa";  // "none" | "dsa"
    std::string dsa_kernel_backend = "auto";
    int64_t dsa_indexer_n_heads = 4;
    int64_t dsa_indexer_head_dim = 32;
    int64_t dsa_indexer_topk = 64;
    int64_t dsa_indexer_topk_freq = 2;
    int64_t dsa_indexer_skip_topk_offset = 1;
    // Megatron's defaults: the indexer loss off, the dense KL (the seed's recipes set both).
    double dsa_indexer_loss_coeff = 0.0;
    bool dsa_indexer_use_sparse_loss = false;
    bool dsa_indexer_rope_interleaved = true;
    std::vector<std::string> indexer_types;  // explicit per-layer "full"/"shared" list wins

    // Multi-token prediction.
    int64_t mtp_num_layers = 2;
    bool mtp_use_repeated_layer = true;
    bool dsa_mtp_index_kv_share = true;
    std::string mtp_loss_type = "cross_entropy";  // "cross_entropy" | "e2e_tv"
    bool mtp_detach_heads = false;
    // The output head's GEMMs in FP8 under fp8_recipe: blockwise (Megatron's fp8_output_proj,
    // off by default as Megatron keeps the head in bf16): the main head's and the MTP depths'
    // cross-entropy heads (CUDA; the e2e TV loss's logits stay bf16).
    bool fp8_output_proj = false;
    double mtp_loss_scaling_factor = 0.1;

    bool untie_embeddings_and_output_weights = true;

    // Derived helpers.
    int64_t q_head_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }
    int64_t num_moe_layers() const;
    int64_t num_dense_layers() const { return num_layers - num_moe_layers(); }
    bool is_moe_layer(int64_t layer) const;
    // Rows one expert keeps from a micro-batch of `tokens`: ceil(moe_capacity_factor x tokens x
    // top-k / experts), at most tokens; tokens when dropless (factor 0).
    int64_t moe_expert_capacity(int64_t tokens) const;
    // Expert parallelism: the most rows one expert gets from one source's `tokens` in one MoE
    // application (a token picks an expert once: at most `tokens`, the capacity when
    // moe_capacity_factor > 0, ceil(tokens k / E) with force-balanced routing) ...
    int64_t moe_rows_per_expert_from_one_source(int64_t tokens) const;
    // ... the most rows one EP rank's experts can receive in it from all W sources (W x tokens x
    // k would be the bound without these rules) ...
    int64_t moe_ep_dropless_rows(int64_t tokens) const;
    // ... and the rows the CUDA receive buffers are planned for: the dropless bound, or W x the
    // per-pair budget ceil(moe_expert_rank_capacity_factor x tokens x k / W) where that is less.
    int64_t moe_ep_received_rows(int64_t tokens) const;
    // The most tokens of a chunk whose dropless rows fit moe_ep_received_rows(tokens): the
    // eager redo of a step over the budget runs each MoE application in chunks of these.
    int64_t moe_ep_redo_chunk_tokens(int64_t tokens) const;
    bool uses_dsa() const { return experimental_attention_variant == "dsa"; }
    // MTP layers with weights: one applied at every depth (mtp_use_repeated_layer), or one per
    // depth (DeepSeek-V3 style), at layer indices num_layers, num_layers + 1, ...
    int64_t mtp_physical_layers() const {
        return mtp_num_layers == 0 ? 0 : mtp_use_repeated_layer ? 1 : mtp_num_layers;
    }
};

// IndexShare (SPEC §3.3): whether backbone layer `layer0` (0-indexed) computes its own top-k, and
// which layer's top-k a shared layer reuses; an explicit indexer_types wins. MTP layers (layer0 >=
// num_layers) are numbered inside their block from 1, as Megatron numbers them, so they always
// compute their own.
bool dsa_layer_is_full(const ModelConfig& c, int64_t layer0);
int64_t dsa_source_layer(const ModelConfig& c, int64_t layer0);
// Megatron's pipeline rule for IndexShare (top-k is not carried across stages): throws when a
// stage of `stage_layers` (layers per stage, first stage first) starts on a shared layer.
void check_index_share_pipeline_split(const ModelConfig& c,
                                      const std::vector<int64_t>& stage_layers);
// Context parallelism shards the attention through DSA's one-head latent keys: throws for a model
// without DSA (the CPU and CUDA models check it when planned for CP).
void require_dsa_for_context_parallel(const ModelConfig& c);

// Parses `moe_layer_freq`: an int N (every N-th layer is MoE, Megatron semantics: layer i is MoE
// iff i % N == 0), a list literal "[0,1,1]", or the Python-like expression "([0]*2+[1]*19)".
// Anything else is an error naming the key and the offending position.
std::vector<int> parse_moe_layer_freq(const std::string& expr, int64_t num_layers);

}  // namespace sparsetron
