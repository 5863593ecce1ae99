// Run settings (data, batch, schedule, optimizer, parallel layout, precision), with Megatron's
// argument names, plus the few engine-specific keys documented in docs/recipes.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsetron {

struct RunConfig {
    // Data (SPEC §9). data_path: one prefix of .bin/.idx, or "w1 prefix1 w2 prefix2 ...".
    std::vector<std::string> data_path;
    int64_t seq_length = 256;
    int64_t micro_batch_size = 1;
    int64_t global_batch_size = 8;
    int64_t max_seqlen_per_dp_cp_rank = 0;     // 0 = seq_length
    int64_t max_documents_per_microbatch = 0;  // engine key; 0 = derived (see data/packer.h)
    bool use_varlen_dataset = true;
    // Megatron's train/valid/test weights over each dataset's documents (data/split.h). The
    // default keeps every document for training (Megatron's is "969, 30, 1"): runs and data
    // positions from before the key read the same documents.
    std::string split = "100,0,0";
    // TensorBoard event files of every step's scalars in this directory ("" = none).
    std::string tensorboard_dir;
    // Validation every eval_interval iterations (and after the last) over eval_iters steps' worth
    // of micro-batches of the valid part, forward only; none when the valid part is empty.
    int64_t eval_interval = 1000;
    int64_t eval_iters = 100;

    // Loop.
    int64_t train_iters = 300;
    int64_t seed = 1234;
    int64_t log_interval = 10;
    std::string save;
    int64_t save_interval = 0;   // 0 = only at the end
    int64_t save_keep_last = 2;  // engine key: checkpoints kept in `save`
    // Engine key: consecutive steps skipped for non-finite gradients after which the run stops
    // with an error (a diverged run must not "finish"); 0 = never.
    int64_t skipped_iters_limit = 10;
    // Stopping early with a checkpoint (Megatron's keys): on SIGINT/SIGTERM (default on here),
    // after an iteration that is a multiple of exit_interval, or once exit_duration_in_mins
    // have passed (0 = never).
    bool exit_signal_handler = true;
    // Megatron's deadline on one collective; past it the job stops naming the rank that stopped
    // answering (0 = none).
    double distributed_timeout_minutes = 10;
    int64_t exit_interval = 0;
    double exit_duration_in_mins = 0;
    std::string load;
    // Megatron's fresh-start-from-weights keys: `pretrained_checkpoint` (an HF directory or an
    // engine checkpoint) loads weights only; `finetune: true` makes `load` do the same. The run
    // then starts at iteration 0 with fresh optimizer state and data position. A `load` that is
    // an HF directory (config.json, no trainer_state.json) is read that way too.
    std::string pretrained_checkpoint;
    bool finetune = false;

    // Optimizer and schedule (SPEC §7).
    std::string optimizer = "adam";  // "adam" (AdamW) | "muon"
    double lr = 3e-3;
    // The optimizer's and the schedule's keys default as Megatron's (the tiny demo,
    // recipes/tiny.yaml and builtin_tiny_recipe, sets its own).
    double min_lr = 0.0;
    double weight_decay = 0.01;
    double adam_beta1 = 0.9;
    double adam_beta2 = 0.999;
    double adam_eps = 1e-8;
    double clip_grad = 1.0;
    int64_t lr_warmup_iters = 0;
    double lr_warmup_init = 0.0;  // the warm-up's first rate
    // "linear" | "cosine" | "constant" | "WSD" | "inverse-square-root"
    std::string lr_decay_style = "linear";
    int64_t lr_decay_iters = 0;  // 0 = train_iters
    // WSD: the anneal's last iterations and shape ("exponential" | "linear" | "cosine" |
    // "minus_sqrt").
    int64_t lr_wsd_decay_iters = 0;
    std::string lr_wsd_decay_style = "exponential";
    // Muon (SPEC §7): per-head Newton-Schulz orthogonalized momentum for the matrices.
    double muon_momentum = 0.95;
    bool muon_nesterov = false;
    bool muon_split_qkv = false;
    bool muon_split_qkv_per_head = false;
    std::string muon_scale_mode = "spectral";
    double muon_extra_scale_factor = 1.0;
    std::string muon_coefficient_type = "quintic";
    int64_t muon_num_ns_steps = 5;
    std::string muon_fp32_matmul_prec = "medium";
    std::string muon_ns_method = "standard";  // engine key: "standard" | "gram"

    // Parallel layout (SPEC §10).
    int64_t tensor_model_parallel_size = 1;
    int64_t pipeline_model_parallel_size = 1;
    // Layers of the first and last pipeline stages (0: an even share; config/pipeline_split.h).
    int64_t decoder_first_pipeline_num_layers = 0;
    int64_t decoder_last_pipeline_num_layers = 0;
    // Megatron's layout string, e.g. "Et*18|t*20|t*20|t*20,m*7,L" (config/pipeline_layout.h); in
    // place of the two keys above.
    std::string pipeline_model_parallel_layout;
    // Interleaved (virtual) pipeline stages, Megatron's two keys (0: unset; one stage per rank):
    // each rank holds that many model chunks, or chunks of that many layers
    // (config/pipeline_split.h: pipeline_virtual_stages).
    int64_t num_virtual_stages_per_pipeline_rank = 0;
    int64_t num_layers_per_virtual_pipeline_stage = 0;
    int64_t expert_model_parallel_size = 1;
    int64_t context_parallel_size = 1;
    bool dynamic_context_parallel = false;
    // Megatron's per-token loss: the indexer KL is summed over rows and divided by the global
    // batch's loss tokens (not a mean per micro-batch), so the grouping of documents into
    // micro-batches changes neither it nor its gradient. Dynamic CP requires it, as in Megatron.
    bool calculate_per_token_loss = false;
    // Data-parallel ranks split the optimizer's work: each updates the parameters it owns (whole
    // matrices for Muon), then every parameter is broadcast from its owner.
    bool use_distributed_optimizer = false;
    // Megatron's gradient buffer keys, with Megatron's rules for bf16 training: gradients
    // accumulate over micro-batches and reduce in fp32, unless grad_reduce_in_bf16 (CUDA: bf16
    // gradient buffers for the weights GEMMs write, cuda::bf16_gradient_allowed; the CPU backend
    // stays fp32, the parity reference). accumulate_allreduce_grads_in_fp32: false alone is set
    // back to fp32, as Megatron does when the main gradients are fp32.
    bool accumulate_allreduce_grads_in_fp32 = true;
    bool grad_reduce_in_bf16 = false;
    // CUDA: that fraction (by bytes) of the fp32 masters this rank updates, each with its
    // optimizer state, in pinned host memory that the optimizer's kernels read and write over
    // the host link (Megatron's keys; Megatron runs that part's step on the CPU instead).
    bool optimizer_cpu_offload = false;
    double optimizer_offload_fraction = 1.0;
    // Data parallelism on GPUs: reduce gradient buckets on a side stream during the last
    // micro-batch's backward (Megatron's --overlap-grad-reduce; on by default here).
    bool overlap_grad_reduce = true;
    // Engine key: the expert-parallel exchange's transport on GPUs
    // (parallel/expert/exchange_transport.h): "auto" (NVLink within a node, NCCL across nodes) |
    // "nvlink" | "nccl".
    std::string moe_expert_exchange = "auto";
    std::string sequence_packing_scheduler = "default";
    int64_t world_size = 1;  // engine key: GPUs the recipe is laid out for (derives DP)

    // Precision.
    bool bf16 = true;
    std::string fp8_recipe = "";  // "" | "blockwise" | "mxfp8"
    std::string fp8_format = "e4m3";
    bool fp8_param_gather = false;
    bool reuse_grad_buf_for_mxfp8_param_ag = false;

    // Execution.
    std::string cuda_graph_impl = "none";  // "none" | "local" (chunk-wise) | "full_iteration"
    // Eager steps before the graphs are captured (Megatron's default; at least one: GEMM plans
    // and kernel attributes are made there).
    int64_t cuda_graph_warmup_steps = 3;
    // Megatron's per-module scopes of the layer graphs (empty: the whole layer, the only form
    // built) and its older spelling of the graph kind ("full_iteration" migrates to
    // cuda_graph_impl, "full" is the whole layer).
    std::vector<std::string> cuda_graph_modules;
    std::string cuda_graph_scope;
    int64_t loss_chunk_rows = 0;  // engine key: rows per fused head+loss chunk; 0 = derived
    // Engine key, SPEC §3.2: DSA dense warm-up -- attention over every causal key (top-k widened to
    // the micro-batch), the dense indexer loss, and only the indexer's weights updated.
    bool dsa_dense_warmup = false;

    int64_t data_parallel_size() const;
    int64_t microbatches_per_step() const;
    int64_t tokens_per_microbatch() const { return micro_batch_size * seq_length; }
    // The CUDA model's FP8 linears (model/cuda/fp8_linear.h) are on.
    bool fp8_blockwise() const { return fp8_recipe == "blockwise"; }
};

}  // namespace sparsetron
