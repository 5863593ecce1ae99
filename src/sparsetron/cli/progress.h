// Training progress on screen: a redrawn bar on a terminal, plain log lines otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "sparsetron/runtime/trainer.h"

namespace sparsetron::cli {

class Progress {
  public:
    Progress(int64_t first_step, int64_t last_step, int64_t log_interval, bool quiet);
    void update(const StepMetrics& m);
    // The step's validation line, when it ran one.
    void validation(const StepMetrics& m);
    void finish();

  private:
    int64_t first_, last_, interval_;
    bool tty_, quiet_;
    double tokens_ = 0, ms_ = 0;
    std::chrono::steady_clock::time_point start_;
    bool drew_ = false;
};

}  // namespace sparsetron::cli
