// A device call as data (bench/plans/*.yaml): the rows of (name, recipe overrides, micro-batch
// lengths, execution modes) one `sparsetron bench --plan FILE` runs in one process, and the one
// JSON record it writes. A plan file:
//
//   recipe: recipes/glm5.2-proxy-h200.yaml   # a recipe and its overlays, as --recipe
//   warmup: 2                                # untimed steps per row (default 3)
//   iters: 5                                 # timed steps per row and mode (default 10)
//   rows:
//     - name: backbone
//       set: [mtp_num_layers=0, dsa_indexer_loss_coeff=0]   # overrides (default none)
//       forward_backward: true                             # no optimizer step (default false)
//       lengths: [4096, 32768]                             # seq_length per sample (default: the
//                                                          # recipe's)
//       variants: [graph]                                  # eager, local, graph (default
//                                                          # graph)
//       data: true        # the trainer's steps over the recipe's own data (bench --data; its
//                         # run directory runs/<recipe>-bench-<name>), not one document
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/perf/bench.h"

namespace sparsetron {

struct BenchPlanRow {
    std::string name;
    std::vector<std::string> overrides;
    bool forward_backward = false;
    std::vector<int64_t> lengths;  // empty: the recipe's seq_length
    std::vector<std::string> variants{"graph"};
    bool data = false;
};

struct BenchPlan {
    std::string path;    // where it was read from (recorded)
    std::string recipe;  // a recipe and its overlays
    int64_t warmup = 3, iters = 10;
    std::vector<BenchPlanRow> rows;
};

// Reads and checks a plan file (YAML; built into the static recipe library with the YAML
// reader). Throws naming the file and the field.
BenchPlan load_bench_plan(const std::string& path);

// Every row at every length, each through run_bench with the plan's warm-up and iterations (the
// recipe `load`ed under the row's overrides and seq_length), each row's table printed on stdout as
// it completes. Returns one JSON record: the plan, the GPU, the commit and every row's results.
std::string run_bench_plan(const BenchPlan& plan, const RecipeLoader& load,
                           const BenchOptions& options);

}  // namespace sparsetron
