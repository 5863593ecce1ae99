#include "progress.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace sparsetron::cli {

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
            "step %lld/%lld | lm_loss %.4f | lr %.3e | grad_norm %.4f | %.1f ms/step | "
            "%.1fk tok/s%s\n",
            static_cast<long long>(m.step), static_cast<long long>(last_), m.lm_loss, m.lr,
            m.grad_norm, m.step_ms, tok_s / 1000.0,
            m.skipped ? " | SKIPPED (non-finite gradient)" : "");
        std::fflush(stdout);
    }
}

void Progress::finish() {
    if (drew_) std::printf("\n");
    std::fflush(stdout);
}

}  // namespace sparsetron::cli
