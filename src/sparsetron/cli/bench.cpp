// `sparsetron bench`: CUDA-event step times of a recipe's training step on the GPU, variants
// interleaved in one allocation, audited TFLOPS, memory in use against the plan.
#include <cstdio>
#include <fstream>
#include <memory>

#include "command.h"
#include "sparsetron/core/error.h"
#include "sparsetron/perf/bench.h"
#include "sparsetron/perf/bench_plan.h"
#include "sparsetron/runtime/run_setup.h"

namespace sparsetron::cli {

Run add_bench(CLI::App& app) {
    struct Options {
        BenchOptions b;
        std::string recipe, variants = "eager", plan;
        JsonOutput json;
        std::vector<std::string> sets, recipe_variants;
        int64_t rounds = 2;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("bench", "Time training steps of a recipe on the GPU");
    c->add_option("--recipe", o->recipe,
                  "Recipe YAML, or a recipe and its overlays: base.yaml,overlay.yaml");
    c->add_option("--plan", o->plan,
                  "A bench plan (bench/plans/*.yaml): its rows of overrides, lengths and modes "
                  "in one run, one JSON record (--json); instead of --recipe");
    c->add_option("--set", o->sets, "Override a recipe key (key=value), repeatable");
    c->add_option("--warmup", o->b.warmup, "Untimed iterations first (default 3)");
    c->add_option("--iters", o->b.iters, "Timed iterations (default 10)");
    c->add_flag("--forward-backward", o->b.forward_backward_only,
                "Time forward+backward only (no optimizer step)");
    c->add_flag("--data", o->b.data,
                "Time the trainer's steps over the recipe's own data (data_path, or the bundled "
                "corpus) instead of one synthetic document: wall-clock step times as `train "
                "--timed-window` takes them, audited FLOPs of each step's documents");
    c->add_option("--out", o->b.data_out,
                  "With --data: the run directory (its data and lock; default runs/<recipe>-bench; "
                  "no checkpoint is written)");
    c->add_option("--variants", o->variants,
                  "Execution modes, comma-separated: eager, local (chunk-wise graphs), graph (the "
                  "whole step; interleaved A B B A in one "
                  "allocation; default eager)");
    c->add_option("--variant", o->recipe_variants,
                  "A recipe variant NAME=\"--set key=value ...\" (repeatable; each its own "
                  "engine, run in rounds A B B A ...), e.g. --variant bf16= --variant "
                  "fp8=\"--set fp8_recipe=blockwise\"");
    c->add_option("--rounds", o->rounds, "Rounds of the recipe variants (default 2: A B B A)");
    c->add_option("--commit", o->b.commit, "Commit recorded in the result");
    add_json_output(c, o->json, "Each result (a plan: one record)");
    return [o] {
        ST_CHECK(o->plan.empty() != o->recipe.empty(), "bench: give --recipe or --plan (one)");
        if (!o->plan.empty()) {
            const BenchPlan plan = load_bench_plan(o->plan);
            connect_gpus_if_launched(Device::CUDA);
            o->b.comm = launch_comm();
            const std::string record = run_bench_plan(
                plan,
                [&](const std::vector<std::string>& sets) {
                    std::vector<std::string> all = o->sets;
                    all.insert(all.end(), sets.begin(), sets.end());
                    return resolve_run(RunRequest::of(RunRequest::Bench, plan.recipe, all)).recipe;
                },
                o->b);
            if (launch_comm() && launch_comm()->rank() != 0) return 0;
            o->json.write(record);
            return 0;
        }
        const Recipe r = resolve_run(RunRequest::of(RunRequest::Bench, o->recipe, o->sets)).recipe;
        ST_CHECK(o->b.data || o->b.data_out.empty(), "bench: --out goes with --data");
        if (o->b.data && o->b.data_out.empty()) o->b.data_out = default_bench_data_out(o->recipe);
        std::vector<BenchVariant> variants;
        for (const std::string& v : o->recipe_variants) variants.push_back(parse_bench_variant(v));
        o->b.variants = split_list(o->variants);
        connect_gpus_if_launched(Device::CUDA);
        o->b.comm = launch_comm();
        const std::vector<BenchResult> res = run_bench_variants(
            [&](const std::vector<std::string>& sets) {
                return resolve_run(RunRequest::of(RunRequest::Bench, o->recipe, sets)).recipe;
            },
            o->sets, variants, o->rounds, o->b);
        if (launch_comm() && launch_comm()->rank() != 0) return 0;  // rank 0 reports
        std::printf(
            "%s | %s%s | %s | %s, %lld warm-up + %lld timed per "
            "variant%s\n%s\n",
            r.name.c_str(), res.front().gpu.c_str(),
            res.front().gpus > 1
                ? cat(" x ", res.front().gpus, " (data parallel",
                      res.front().cp_ranks > 1
                          ? cat(r.run.dynamic_context_parallel ? " x dynamic context parallel "
                                                               : " x context parallel ",
                                res.front().cp_ranks)
                          : std::string(),
                      r.run.expert_model_parallel_size > 1
                          ? cat(", expert parallel ", r.run.expert_model_parallel_size)
                          : std::string(),
                      ", per GPU)")
                      .c_str()
                : "",
            res.front().commit.c_str(),
            o->b.data ? "the recipe's data, wall-clock trainer steps" : "CUDA-event step times",
            static_cast<long long>(o->b.warmup), static_cast<long long>(o->b.iters),
            variants.empty() ? "" : cat(" and round, ", o->rounds, " rounds").c_str(),
            bench_table(res).c_str());
        for (const auto& x : res) o->json.write(x.to_json());
        return 0;
    };
}

}  // namespace sparsetron::cli
