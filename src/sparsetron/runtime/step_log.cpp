#include "sparsetron/runtime/step_log.h"

#include "sparsetron/core/error.h"

namespace sparsetron {

void write_step_scalars(TensorBoardWriter& tb, const StepMetrics& m, double memory_gib) {
    const int64_t s = m.step;
    tb.scalar("lm loss", s, m.lm_loss);
    if (m.mtp_loss > 0) tb.scalar("mtp loss", s, m.mtp_loss);
    if (m.mtp_acceptance_length > 0) tb.scalar("mtp acceptance length", s, m.mtp_acceptance_length);
    tb.scalar("indexer loss", s, m.indexer_loss);
    for (const auto& [layer, loss] : m.indexer_loss_layers)
        tb.scalar(cat("indexer-loss/layer-", layer), s, loss);
    if (m.aux_loss > 0) tb.scalar("aux loss", s, m.aux_loss);
    tb.scalar("total loss", s, m.total_loss);
    tb.scalar("learning-rate", s, m.lr);
    tb.scalar("grad-norm", s, m.grad_norm);
    if (m.grad_norm_mtp > 0) tb.scalar("grad-norm mtp", s, m.grad_norm_mtp);
    tb.scalar("skipped", s, m.skipped ? 1.0 : 0.0);
    tb.scalar("iteration-time/ms", s, m.step_ms);
    if (m.step_ms > 0)
        tb.scalar("throughput/tokens-per-second", s, double(m.tokens) * 1e3 / m.step_ms);
    tb.scalar("memory/gib", s, memory_gib);
    for (size_t l = 0; l < m.moe_load.size(); ++l)
        for (size_t e = 0; e < m.moe_load[l].size(); ++e)
            tb.scalar(cat("moe-load/layer-", l, "/expert-", e), s, double(m.moe_load[l][e]));
    if (!m.moe_load.empty()) tb.scalar("moe dropped", s, double(m.moe_dropped));
    if (m.valid) {
        tb.scalar("lm loss validation", s, m.valid->lm_loss);
        if (m.valid->mtp_loss > 0) tb.scalar("mtp loss validation", s, m.valid->mtp_loss);
    }
}

}  // namespace sparsetron
