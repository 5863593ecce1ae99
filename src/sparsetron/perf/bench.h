// The step benchmark (`sparsetron bench`): times whole training steps, or the forward+backward
// alone, of a recipe on one synthetic document per micro-batch slot, with CUDA events. Execution
// modes (eager launches, a replayed CUDA graph) run interleaved A B B A in one device allocation,
// so drift (clocks, temperature) falls on both alike. Recipe variants (named override sets, e.g.
// fp8 = fp8_recipe=blockwise) each need an engine of their own: they run in rounds A B B A ...,
// an engine built for each, their times pooled per variant.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "sparsetron/config/recipe.h"
#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/perf/rank_ranges.h"

namespace sparsetron {

struct BenchOptions {
    int64_t warmup = 3, iters = 10;              // per variant
    bool forward_backward_only = false;          // no optimizer step
    std::string commit;                          // recorded as given
    std::vector<std::string> variants{"eager"};  // execution modes: "eager", "graph"
    // Data parallelism over these ranks (NCCL, one GPU each): every rank times its own
    // micro-batches of the step plus the gradient all-reduce; figures are per GPU.
    Comm* comm = nullptr;
    // Time the recipe's own data (run_bench_data) instead of one synthetic document, the run
    // directory (data, lock) in `data_out`.
    bool data = false;
    std::string data_out;
};

struct BenchResult {
    std::string recipe, gpu, commit, variant;
    // How step_ms was taken: "cuda_events" (the staged step), or "wall_clock_trainer_step"
    // (bench --data: the trainer's whole step on the host's clock).
    std::string timing = "cuda_events";
    std::vector<double> step_ms;
    double median_ms = 0, p95_ms = 0, min_ms = 0, max_ms = 0, cv = 0;
    // Mean and its standard error (sample standard deviation / sqrt(n)): what an A/B of two
    // runs can resolve. Replays drift (power, clocks), so it is a lower bound on the real error.
    double mean_ms = 0, se_ms = 0;
    double flops = 0, tflops_per_gpu = 0, tokens_per_s_per_gpu = 0;
    std::vector<std::pair<std::string, double>> flops_terms;
    int64_t tokens = 0;
    double peak_mem_mib = 0, planned_mem_mib = 0;
    // Each figure's range over the ranks of the run (every rank times its own steps): the
    // seed's p95 and CV ranges; min = max with one rank.
    RankRange median_range, p95_range, cv_range, peak_mem_range;
    int gpus = 1;      // data-parallel ranks of the run
    int cp_ranks = 1;  // ranks sharing each micro-batch (context parallelism, fixed or dynamic)
    // The optimizer's Newton-Schulz FLOPs in the timed step (0 with --forward-backward or without
    // Muon): outside the audited count, recorded so a step's hardware work can be read beside it.
    double newton_schulz_flops = 0;
    std::vector<std::string> overrides;  // the recipe keys set for this variant, as given
    // The registered environment variables (core/env.h) set for the run: in the JSON line as
    // "env" when any is set.
    std::map<std::string, std::string> env;
    std::string to_json() const;
    std::string table() const;
};

// The environment variables the engine reads (core/env.h) that are set, with their values.
std::map<std::string, std::string> registered_env();

// A recipe variant of a bench: a name and the recipe overrides ("key=value") it adds.
struct BenchVariant {
    std::string name;
    std::vector<std::string> overrides;
};
// "NAME=SPEC", SPEC being "key=value" words, each optionally after "--set" (as on the command
// line): `fp8=--set fp8_recipe=blockwise`. Throws with the text on a malformed one.
BenchVariant parse_bench_variant(const std::string& text);

// One result per execution mode, in the order given, of one engine built for `recipe` (with
// options.data: run_bench_data).
std::vector<BenchResult> run_bench(const Recipe& recipe, const BenchOptions& options);
// Whole training steps of the recipe's own data (its data_path, or the bundled corpus), as
// `train` runs them (the trainer's step, its wall-clock time: packing, the step, the losses'
// read-back), `warmup` untimed then `iters` timed; one trainer per execution mode in turn (eager:
// cuda_graph_impl none, graph: full_iteration), each from the data's start. Audited FLOPs of each
// timed step's documents (the seed's timed window); no checkpoint is written.
std::vector<BenchResult> run_bench_data(const Recipe& recipe, const BenchOptions& options);
// Its run directory by default: runs/<the first recipe file's stem>-bench<suffix>, beside
// `train`'s runs/<stem>.
std::string default_bench_data_out(const std::string& recipes, const std::string& suffix = "");
// Loads the recipe under a list of overrides (the recipe file and the YAML reader stay with the
// caller: they are outside the engine library).
using RecipeLoader = std::function<Recipe(const std::vector<std::string>& overrides)>;
// Recipe variants of a base recipe (its overrides `base_overrides`, each variant's added after
// them), in `rounds` rounds of A B B A ... order, one engine per run; one result per variant and
// mode (named "VARIANT/MODE"), the rounds' times pooled. Without variants: run_bench of the base.
std::vector<BenchResult> run_bench_variants(const RecipeLoader& load,
                                            const std::vector<std::string>& base_overrides,
                                            const std::vector<BenchVariant>& variants,
                                            int64_t rounds, const BenchOptions& options);

// Variant indices of the timed iterations: blocks of the variants forward then backward
// (A B B A ...), `iters` of each; one variant: A A A.
std::vector<int> abba_order(int variants, int64_t iters);
// Median, p95, min, max, coefficient of variation, mean and its standard error of step_ms into
// `r`.
void summarize_times(BenchResult& r);
// The seed-style table: one row per variant, then each later variant's change against the first.
std::string bench_table(const std::vector<BenchResult>& results);

}  // namespace sparsetron
