// The seed tracker's timed window on a training run (`sparsetron train --timed-window W,M`, the
// seed's 8 warm-up + 20 measured iterations): the steps after W warm-up steps, M of them, as a
// median and p95 step time, their CV, and the audited model TFLOPS per GPU (SPEC §8's count of
// each measured step's documents over its time).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsetron {

class TimedWindow {
  public:
    TimedWindow() = default;
    TimedWindow(int64_t warmup, int64_t measured);
    // "W,M" (both >= 0, M > 0); throws naming the option otherwise.
    static TimedWindow parse(const std::string& text);
    bool active() const { return measured_ > 0; }
    // The run's next step (its time and audited FLOPs): kept when it is a measured one.
    void add(double step_ms, double flops);
    bool complete() const { return active() && int64_t(ms_.size()) == measured_; }
    int64_t warmup() const { return warmup_; }
    int64_t measured() const { return int64_t(ms_.size()); }
    const std::vector<double>& times() const { return ms_; }  // the measured steps', ms
    // Audited FLOPs per measured step, their mean.
    double mean_flops() const;
    double median_ms() const;
    double p95_ms() const;
    double cv() const;
    // Audited FLOPs of the measured steps over their time, per GPU.
    double tflops_per_gpu(int gpus) const;
    // One line: "timed window (steps 9-28 of 28): median ... ms, p95 ... ms, CV ...%, ...".
    std::string summary(int gpus) const;
    std::string to_json(int gpus) const;

  private:
    int64_t warmup_ = 0, measured_ = 0, seen_ = 0;
    std::vector<double> ms_, flops_;
};

}  // namespace sparsetron
