// The loss bookkeeping of a training step (SPEC §5-6), shared by both backends' models, the
// engines and the trainer: how each loss of a micro-batch enters the step's objective, the sums a
// micro-batch's forward returns, and the per-token normalization of the MTP losses over a step.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/data/packer.h"

namespace sparsetron {

// How each loss of one micro-batch enters the step's objective (SPEC §5-6). Gradients are those
// of lm * Σ CE + Σ_k mtp[k] * (depth-k CE sum or TV-chain sum) + indexer * Σ_layers L_I + aux *
// L_aux.
struct LossScales {
    bool backward = false;
    double lm = 0;            // per LM target row: 1 / (targets in the global batch)
    std::vector<double> mtp;  // per depth (cross_entropy) or one value (e2e_tv): per-row weight
    double indexer = 0;       // weight of this micro-batch's indexer loss (1 / micro-batches)
    // Per-token loss (calculate_per_token_loss): the indexer KL's sum over a micro-batch's rows
    // is divided by these tokens of the global batch instead of the micro-batch's rows (its
    // mean); `indexer` is then 1. 0: the mean.
    int64_t indexer_tokens = 0;
    double aux = 0;              // weight of this micro-batch's MoE aux loss
    bool indexer_grads = false;  // indexer gradients without a backward (dense warm-up)
};

struct LossSums {
    double lm_loss_sum = 0;  // Σ CE over LM target rows
    int64_t lm_targets = 0;
    std::vector<double> mtp_sum;     // cross_entropy: Σ CE per depth; e2e_tv: [Σ chain loss]
    std::vector<int64_t> mtp_count;  // rows counted per depth (or [chain rows])
    double mtp_acceptance_sum = 0;   // e2e_tv: Σ over rows of Σ_j Π_{k<=j} α_k
    double indexer_loss = 0;         // Σ over full layers of coeff * mean KL
    // Each indexer's term of indexer_loss: (layer, coeff * mean KL); MTP depth k (1-based) is
    // layer num_layers + k - 1. The layers that compute an indexer, in forward order.
    std::vector<std::pair<int64_t, double>> indexer_layers;
    double aux_loss = 0;      // MoE aux loss of all layers (already weighted by `aux`)
    double mtp_aux_loss = 0;  // the part of aux_loss from the MTP layer's depths
};

// MTP losses are per-token means over every micro-batch of a step (SPEC §6). Their slots: one
// per depth (cross entropy), or one chain (e2e_tv); none without MTP.
int64_t mtp_loss_slots(const ModelConfig& c);
// Adds `mb`'s rows to each slot: depth k counts the rows with a target k + 1 tokens ahead in
// their document, the e2e_tv chain the rows with all D ahead.
void add_mtp_rows(const ModelConfig& c, const MicroBatch& mb, std::vector<int64_t>& rows);
// The MTP loss as training reports it from raw per-slot sums over those rows: λ/D times each
// depth's mean, or λ times the chain's mean.
double reported_mtp_loss(const ModelConfig& c, const std::vector<double>& sums,
                         const std::vector<int64_t>& rows);

}  // namespace sparsetron
