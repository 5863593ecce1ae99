#include "sparsetron/runtime/step_metrics.h"

#include <nlohmann/json.hpp>

namespace sparsetron {

std::string StepMetrics::to_json() const {
    nlohmann::ordered_json j;
    j["step"] = step;
    j["lm_loss"] = lm_loss;
    j["mtp_loss"] = mtp_loss;
    j["indexer_loss"] = indexer_loss;
    if (!indexer_loss_layers.empty()) {
        nlohmann::ordered_json per_layer;
        for (const auto& [layer, loss] : indexer_loss_layers)
            per_layer[std::to_string(layer)] = loss;
        j["indexer_loss_per_layer"] = per_layer;
    }
    j["aux_loss"] = aux_loss;
    j["total_loss"] = total_loss;
    if (mtp_acceptance_length > 0) j["mtp_acceptance_length"] = mtp_acceptance_length;
    if (!moe_load.empty()) {
        j["moe_load"] = moe_load;
        j["moe_dropped"] = moe_dropped;
    }
    if (moe_stash_pages > 0) {
        j["moe_stash_pages"] = moe_stash_pages;
        j["moe_stash_peak_pages"] = moe_stash_peak_pages;
        j["moe_stash_redos"] = moe_stash_redos;
        if (moe_stash_redo) j["moe_stash_redo"] = true;
    }
    if (moe_budget_redos > 0) j["moe_budget_redos"] = moe_budget_redos;
    if (moe_budget_redo) j["moe_budget_redo"] = true;
    j["lr"] = lr;
    j["grad_norm"] = grad_norm;
    if (grad_norm_mtp > 0) j["grad_norm_mtp"] = grad_norm_mtp;
    j["tokens"] = tokens;
    j["targets"] = targets;
    j["step_ms"] = step_ms;
    j["skipped"] = skipped;
    if (!dynamic_cp_groups.empty()) {
        j["dynamic_cp_groups"] = dynamic_cp_groups;
        j["dynamic_cp_idle_ranks"] = dynamic_cp_idle_ranks;
    }
    if (graph) j["graph"] = true;
    if (valid) {
        j["valid_lm_loss"] = valid->lm_loss;
        if (valid->mtp_loss > 0) j["valid_mtp_loss"] = valid->mtp_loss;
        j["valid_targets"] = valid->targets;
    }
    return j.dump();
}

}  // namespace sparsetron
