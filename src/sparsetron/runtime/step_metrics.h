// What one training step reports: its losses (summed over ranks, on Megatron's scale), the routing
// statistics, the optimizer's figures and the step's time; one line of metrics.jsonl.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace sparsetron {

struct StepMetrics {
    int64_t step = 0;
    double lm_loss = 0;
    double mtp_loss = 0;  // λ-scaled, as it enters total_loss (0 without MTP)
    // The DSA indexer loss on Megatron's scale: Σ over the layers computing an indexer of
    // coeff * mean KL (averaged over micro-batches), divided by num_layers as Megatron's log
    // divides it. The objective adds the sum: indexer_loss * num_layers.
    double indexer_loss = 0;
    // Each layer's term of the indexer loss's sum (coeff * mean KL, averaged over the step's
    // micro-batches): (layer, value) for the layers computing an indexer, MTP depth k as layer
    // num_layers + k - 1; Megatron's tracker shows them per layer.
    std::vector<std::pair<int64_t, double>> indexer_loss_layers;
    double aux_loss = 0;               // MoE sequence aux loss (0 when off)
    double total_loss = 0;             // lm + mtp + the indexer loss's sum + aux: the objective
    double mtp_acceptance_length = 0;  // e2e_tv: mean Σ_j Π_{k<=j} α_k over chain rows
    std::vector<std::vector<int64_t>> moe_load;  // per MoE layer: tokens per expert in the step
    int64_t moe_dropped = 0;                     // routed rows over capacity in the step
    int64_t moe_stash_pages = 0;       // MoE paged stash: pool pages (0 without the stash)
    int64_t moe_stash_peak_pages = 0;  // most pages in use at once in the step
    // The stash overflowed and the step ran again eagerly without it; moe_stash_redos counts
    // such steps since the run (or its resume) began.
    bool moe_stash_redo = false;
    int64_t moe_stash_redos = 0;
    // The routing went over the expert-parallel receive budget (moe_expert_rank_capacity_factor)
    // and the step ran again eagerly in token chunks; moe_budget_redos counts such steps since
    // the run (or its resume) began.
    bool moe_budget_redo = false;
    int64_t moe_budget_redos = 0;
    double lr = 0;
    double grad_norm = 0;
    double grad_norm_mtp = 0;  // the MTP clipping group's norm (detached heads), else 0
    int64_t tokens = 0;        // real tokens in the step
    // The step's documents' lengths (every micro-batch of the global batch): what its audited
    // FLOPs count (perf/flops.h). Not in the JSON line.
    std::vector<int64_t> doc_lengths;
    int64_t targets = 0;  // loss rows in the step
    double step_ms = 0;
    bool skipped = false;
    bool graph = false;  // the step ran as a CUDA graph replay (cuda_graph_impl full_iteration)
    // Dynamic CP: groups the step ran, by CP size (entry i: size 2^i), and the ranks left
    // without a group, summed over the step's scheduled micro-batches.
    std::vector<int64_t> dynamic_cp_groups;
    int64_t dynamic_cp_idle_ranks = 0;
    // Validation after this step (eval_interval): set when it ran.
    struct Valid {
        double lm_loss = 0;
        double mtp_loss = 0;  // λ-scaled like mtp_loss (0 without MTP)
        int64_t targets = 0;  // LM target rows it averaged over
        int64_t micro_batches = 0;
    };
    std::optional<Valid> valid;
    std::string to_json() const;
};

}  // namespace sparsetron
