#include "sparsetron/perf/timed_window.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "sparsetron/core/error.h"
#include "sparsetron/perf/bench.h"
#include "sparsetron/perf/flops.h"

namespace sparsetron {
TimedWindow::TimedWindow(int64_t warmup, int64_t measured) : warmup_(warmup), measured_(measured) {
    ST_CHECK(warmup >= 0 && measured > 0, "--timed-window: ", warmup, " warm-up and ", measured,
             " measured steps (warm-up >= 0, measured > 0)");
}

TimedWindow TimedWindow::parse(const std::string& text) {
    long long w = -1, m = -1;
    char tail = 0;
    ST_CHECK(std::sscanf(text.c_str(), "%lld,%lld%c", &w, &m, &tail) == 2, "--timed-window '", text,
             "': expected WARMUP,MEASURED steps, e.g. 8,20");
    return TimedWindow(w, m);
}

void TimedWindow::add(double step_ms, double flops) {
    if (!active() || complete()) return;
    if (seen_++ < warmup_) return;
    ms_.push_back(step_ms);
    flops_.push_back(flops);
}

// The bench's statistics of the measured steps (0 before any).
static BenchResult measured_stats(const std::vector<double>& ms) {
    BenchResult r;
    r.step_ms = ms;
    if (!ms.empty()) summarize_times(r);
    return r;
}

double TimedWindow::median_ms() const {
    return measured_stats(ms_).median_ms;
}

double TimedWindow::p95_ms() const {
    return measured_stats(ms_).p95_ms;
}

double TimedWindow::cv() const {
    return measured_stats(ms_).cv;
}

double TimedWindow::mean_flops() const {
    double f = 0;
    for (double x : flops_) f += x;
    return flops_.empty() ? 0.0 : f / double(flops_.size());
}

double TimedWindow::tflops_per_gpu(int gpus) const {
    double f = 0, s = 0;
    for (size_t i = 0; i < ms_.size(); ++i) f += flops_[i], s += ms_[i] * 1e-3;
    return s > 0 ? f / s / double(std::max(gpus, 1)) / 1e12 : 0.0;
}

std::string TimedWindow::summary(int gpus) const {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "timed window (steps %lld-%lld of the run): median %.1f ms, p95 %.1f ms, CV "
                  "%.2f%%, audited %.1f TFLOPS/GPU over %d GPU%s",
                  static_cast<long long>(warmup_ + 1),
                  static_cast<long long>(warmup_ + int64_t(ms_.size())), median_ms(), p95_ms(),
                  100.0 * cv(), tflops_per_gpu(gpus), gpus, gpus == 1 ? "" : "s");
    return complete() ? std::string(buf)
                      : cat(buf, " (", ms_.size(), " of ", measured_,
                            " measured steps: the run ended first)");
}

std::string TimedWindow::to_json(int gpus) const {
    nlohmann::ordered_json j;
    j["warmup_steps"] = warmup_;
    j["measured_steps"] = int64_t(ms_.size());
    j["complete"] = complete();
    j["median_ms"] = median_ms();
    j["p95_ms"] = p95_ms();
    j["cv"] = cv();
    j["tflops_per_gpu"] = tflops_per_gpu(gpus);
    j["gpus"] = gpus;
    j["step_ms"] = ms_;
    j["flops_per_step"] = flops_;
    j["flops_convention"] = FlopCount::convention();
    return j.dump();
}

}  // namespace sparsetron
