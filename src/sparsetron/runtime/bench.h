// The step benchmark (a first form of `sparsetron bench`; the tracker issue adds variants, ABBA
// interleaving, CUDA-event timing and the history): times whole training steps, or the
// forward+backward alone, of a recipe on one synthetic document per micro-batch slot.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "sparsetron/config/recipe.h"

namespace sparsetron {

struct BenchOptions {
    int64_t warmup = 3, iters = 10;
    bool forward_backward_only = false;  // no optimizer step
    std::string commit;                  // recorded as given
};

struct BenchResult {
    std::string recipe, gpu, commit, variant;
    std::vector<double> step_ms;
    double median_ms = 0, p95_ms = 0, min_ms = 0, max_ms = 0;
    double flops = 0, tflops_per_gpu = 0, tokens_per_s_per_gpu = 0;
    std::vector<std::pair<std::string, double>> flops_terms;
    int64_t tokens = 0;
    double peak_mem_mib = 0, planned_mem_mib = 0;
    std::string to_json() const;
    std::string table() const;
};

BenchResult run_bench(const Recipe& recipe, const BenchOptions& options);

}  // namespace sparsetron
