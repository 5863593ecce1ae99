// `sparsetron bench --data`: the trainer's own steps over the recipe's data, timed as `train
// --timed-window` times them, as bench results.
#include <algorithm>
#include <filesystem>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/perf/bench.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/perf/timed_window.h"
#include "sparsetron/runtime/trainer.h"

namespace sparsetron {

std::string default_bench_data_out(const std::string& recipes, const std::string& suffix) {
    const std::string first = recipes.substr(0, recipes.find(','));
    return (std::filesystem::path("runs") /
            (std::filesystem::path(first).stem().string() + "-bench" + suffix))
        .string();
}

std::vector<BenchResult> run_bench_data(const Recipe& recipe_in, const BenchOptions& o) {
    ST_CHECK(o.iters > 0 && o.warmup >= 0, "bench: --iters must be positive");
    ST_CHECK(!o.forward_backward_only,
             "bench --data times whole training steps; --forward-backward times one synthetic "
             "document (leave out --data)");
    ST_CHECK(!o.data_out.empty(), "bench --data: no run directory");
    std::vector<BenchResult> results;
    for (const std::string& mode : o.variants) {
        ST_CHECK(mode == "eager" || mode == "local" || mode == "graph", "bench: unknown variant '",
                 mode, "' (eager, local, graph)");
        Recipe recipe = recipe_in;
        recipe.run.cuda_graph_impl = mode == "graph"   ? "full_iteration"
                                     : mode == "local" ? "local"
                                                       : "none";
        // The schedule's length only shapes the learning rate, not the work of a step.
        recipe.run.train_iters = std::max(recipe.run.train_iters, o.warmup + o.iters);
        Trainer trainer(recipe, TrainOptions{o.data_out, "", Device::CUDA, false, o.comm});
        TimedWindow window(o.warmup, o.iters);
        int64_t tokens = 0;
        for (int64_t i = 0; i < o.warmup + o.iters; ++i) {
            const StepMetrics m = trainer.train_step();
            window.add(m.step_ms, audited_flops(recipe.model, m.doc_lengths).total);
            if (i >= o.warmup) tokens += m.tokens;
        }
        BenchResult r;
        r.recipe = recipe_in.name;
        r.gpu = cuda_device_name();
        r.commit = o.commit;
        r.env = registered_env();
        r.variant = "data." + mode;
        r.timing = "wall_clock_trainer_step";
        r.step_ms = window.times();
        summarize_times(r);
        const int gpus = trainer.world_size();
        r.tflops_per_gpu = window.tflops_per_gpu(gpus);
        r.flops = window.mean_flops();
        r.tokens = tokens / o.iters;
        r.tokens_per_s_per_gpu = double(r.tokens) / (r.mean_ms * 1e-3) / double(gpus);
        r.peak_mem_mib = trainer.memory_gib() * 1024.0;
        const std::vector<RankRange> across =
            ranges_across_ranks(o.comm, {r.median_ms, r.p95_ms, r.cv, r.peak_mem_mib});
        r.median_range = across[0], r.p95_range = across[1], r.cv_range = across[2];
        r.peak_mem_range = across[3];
        r.planned_mem_mib = trainer.bench() ? trainer.bench()->planned_memory_mib() : 0.0;
        r.gpus = gpus;
        results.push_back(std::move(r));
    }
    return results;
}

}  // namespace sparsetron
