// Audited model FLOPs per step (SPEC §8): the count every TFLOPS figure of the engine uses.
// 2 FLOPs per multiply-add, a trained GEMM costs 3x its forward; only real tokens count.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sparsetron/config/model_config.h"

namespace sparsetron {

struct FlopCount {
    double total = 0;
    int64_t tokens = 0;
    std::vector<std::pair<std::string, double>> terms;  // name, FLOPs (sums to total)
    static const char* convention();
};

// One step over documents of the given lengths (one entry per document of the global batch).
FlopCount audited_flops(const ModelConfig& m, const std::vector<int64_t>& doc_lengths);

// Megatron-LM's stock num_floating_point_operations (dev + PR 6753, DSA branch), for comparison:
// an average-length pair approximation, indexers on every non-skip layer number up to L+D, draft
// heads counted 3x, no KV-share correction (docs/perf/flops.md).
FlopCount megatron_flops(const ModelConfig& m, const std::vector<int64_t>& doc_lengths);

}  // namespace sparsetron
