#include "progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>

namespace sparsetron::cli {
namespace {

// " | mtp 0.0123 (accept 1.71) | indexer 0.00001 | aux 0.0010 | moe dropped 3 | moe stash 92%",
// parts present only when the recipe has them (stash: peak pages in use / pool pages).
std::string loss_breakdown(const StepMetrics& m) {
    std::string s;
    char buf[96];
    if (m.mtp_loss > 0) std::snprintf(buf, sizeof buf, " | mtp %.4f", m.mtp_loss), s += buf;
    if (m.mtp_acceptance_length > 0)
        std::snprintf(buf, sizeof buf, " (accept %.2f)", m.mtp_acceptance_length), s += buf;
    if (m.indexer_loss > 0)
        std::snprintf(buf, sizeof buf, " | indexer %.2e", m.indexer_loss), s += buf;
    if (m.aux_loss > 0) std::snprintf(buf, sizeof buf, " | aux %.4f", m.aux_loss), s += buf;
    if (m.moe_dropped > 0)
        std::snprintf(buf, sizeof buf, " | moe dropped %lld",
                      static_cast<long long>(m.moe_dropped)),
            s += buf;
    if (m.moe_stash_pages > 0)
        std::snprintf(buf, sizeof buf, " | moe stash %.0f%%%s",
                      100.0 * double(m.moe_stash_peak_pages) / double(m.moe_stash_pages),
                      m.moe_stash_redo ? " (overflow: redone eagerly)" : ""),
            s += buf;
    if (m.moe_budget_redo) s += " | moe over the receive budget: redone in chunks";
    return s;
}

}  // namespace

Progress::Progress(int64_t first, int64_t last, int64_t interval, bool quiet)
    : first_(first),
      last_(last),
      interval_(interval),
      tty_(::isatty(STDOUT_FILENO) != 0),
      quiet_(quiet),
      start_(std::chrono::steady_clock::now()) {}

void Progress::update(const StepMetrics& m) {
    tokens_ += double(m.tokens);
    ms_ += m.step_ms;
    if (quiet_) return;
    const double tok_s = ms_ > 0 ? tokens_ / (ms_ / 1000.0) : 0;
    const int64_t done = m.step - first_, total = last_ - first_;
    const double eta_s = done > 0 ? ms_ / double(done) * double(total - done) / 1000.0 : 0;
    if (tty_) {
        constexpr int kWidth = 24;
        int filled = total > 0 ? static_cast<int>(kWidth * done / total) : kWidth;
        std::string bar(filled, '#');
        bar += std::string(kWidth - filled, '.');
        std::printf(
            "\r[%s] %lld/%lld  loss %.4f  lr %.2e  gnorm %.3f  %.0f ms/step  %.1fk tok/s  "
            "ETA %lld:%02lld%s\x1b[K",
            bar.c_str(), static_cast<long long>(m.step), static_cast<long long>(last_), m.lm_loss,
            m.lr, m.grad_norm, m.step_ms, tok_s / 1000.0, static_cast<long long>(eta_s) / 60,
            static_cast<long long>(eta_s) % 60, m.skipped ? "  [skipped: non-finite grad]" : "");
        std::fflush(stdout);
        drew_ = true;
    } else if (m.step % interval_ == 0 || m.step == last_ || m.step == first_ + 1 || m.skipped) {
        std::printf(
            "step %lld/%lld | lm_loss %.4f%s | lr %.3e | grad_norm %.4f | %.1f ms/step | "
            "%.1fk tok/s%s\n",
            static_cast<long long>(m.step), static_cast<long long>(last_), m.lm_loss,
            loss_breakdown(m).c_str(), m.lr, m.grad_norm, m.step_ms, tok_s / 1000.0,
            m.skipped ? " | SKIPPED (non-finite gradient)" : "");
        std::fflush(stdout);
    }
}

void Progress::validation(const StepMetrics& m) {
    if (quiet_ || !m.valid) return;
    const StepMetrics::Valid& v = *m.valid;
    std::printf("%svalidation after step %lld | lm_loss %.4f (perplexity %.2f)%s | %lld targets\n",
                drew_ ? "\n" : "", static_cast<long long>(m.step), v.lm_loss, std::exp(v.lm_loss),
                v.mtp_loss > 0 ? cat(" | mtp_loss ", v.mtp_loss).c_str() : "",
                static_cast<long long>(v.targets));
    std::fflush(stdout);
    drew_ = false;
}

void Progress::finish() {
    if (drew_) std::printf("\n");
    std::fflush(stdout);
}

}  // namespace sparsetron::cli
