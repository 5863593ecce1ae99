// The bench's pure parts: the A B B A order, the step-time statistics and the table with its
// delta row (the GPU part of `sparsetron bench` runs on the GPU machine).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "sparsetron/core/error.h"
#include "sparsetron/perf/bench.h"
#include "sparsetron/perf/timed_window.h"

namespace sparsetron {
namespace {

TEST(BenchStats, VariantsInterleaveABBA) {
    EXPECT_EQ(abba_order(2, 4), (std::vector<int>{0, 1, 1, 0, 0, 1, 1, 0}));
    EXPECT_EQ(abba_order(1, 3), (std::vector<int>{0, 0, 0}));
    EXPECT_EQ(abba_order(3, 2), (std::vector<int>{0, 1, 2, 2, 1, 0}));
    // Every variant gets exactly `iters` timed iterations.
    auto o = abba_order(2, 5);
    EXPECT_EQ(std::count(o.begin(), o.end(), 0), 5);
    EXPECT_EQ(std::count(o.begin(), o.end(), 1), 5);
}

TEST(BenchStats, MedianP95MinMaxAndCv) {
    BenchResult r;
    r.step_ms = {10, 12, 11, 13, 14};
    summarize_times(r);
    EXPECT_DOUBLE_EQ(r.median_ms, 12);
    EXPECT_DOUBLE_EQ(r.min_ms, 10);
    EXPECT_DOUBLE_EQ(r.max_ms, 14);
    EXPECT_NEAR(r.p95_ms, 13.8, 1e-12);  // linear between the 4th and 5th of the sorted times
    // Sample standard deviation sqrt(2.5) over the mean 12; its standard error sqrt(2.5 / 5).
    EXPECT_NEAR(r.cv, std::sqrt(2.5) / 12.0, 1e-12);
    EXPECT_DOUBLE_EQ(r.mean_ms, 12);
    EXPECT_NEAR(r.se_ms, std::sqrt(0.5), 1e-12);
    BenchResult one;
    one.step_ms = {7};
    summarize_times(one);
    EXPECT_DOUBLE_EQ(one.mean_ms, 7);
    EXPECT_DOUBLE_EQ(one.se_ms, 0);
    EXPECT_DOUBLE_EQ(one.cv, 0);
    BenchResult empty;
    EXPECT_THROW(summarize_times(empty), Error);
}

// The cross-rank columns: alone, each figure's range is itself; with several ranks the table
// prints each range and the JSON line carries them (Mpi.BenchFiguresRangeOverEveryRank gathers
// them over MPI ranks).
TEST(BenchStats, RangesAcrossRanksInTheTableAndTheJson) {
    const auto alone = ranges_across_ranks(nullptr, {3.5, 7.0});
    ASSERT_EQ(alone.size(), 2u);
    EXPECT_EQ(alone[0].min, 3.5);
    EXPECT_EQ(alone[0].max, 3.5);
    EXPECT_EQ(alone[1].max, 7.0);
    BenchResult r;
    r.variant = "step.graph";
    r.step_ms = {100, 102, 101};
    summarize_times(r);
    r.gpus = 16;
    r.median_range = {100.5, 104.0}, r.p95_range = {101.0, 106.0}, r.cv_range = {0.003, 0.004};
    r.peak_mem_range = {1000, 1010};
    const std::string t = bench_table({r});
    EXPECT_NE(t.find("step.graph across 16 ranks: median 100.5-104.0 ms, p95 101.0-106.0 ms, CV "
                     "0.30-0.40 %, in use 1000.0-1010.0 MiB"),
              std::string::npos)
        << t;
    const auto j = nlohmann::json::parse(r.to_json());
    EXPECT_EQ(j["p95_ms_range"], nlohmann::json::array({101.0, 106.0}));
    EXPECT_EQ(j["cv_range"], nlohmann::json::array({0.003, 0.004}));
}

// The timed window keeps the steps after its warm-up, as many as it measures: of steps taking
// 100, 50, 10, 20, 30 and 40 ms with window 2,3 it keeps 10, 20, 30 (median 20, p95 29, CV 0.5);
// 1e12 FLOPs each over 60 ms on 2 GPUs is 25 TFLOPS a GPU.
TEST(BenchStats, TimedWindowKeepsTheMeasuredSteps) {
    TimedWindow w = TimedWindow::parse("2,3");
    EXPECT_TRUE(w.active());
    for (double ms : {100.0, 50.0, 10.0, 20.0}) w.add(ms, 1e12);
    EXPECT_FALSE(w.complete());
    EXPECT_NE(w.summary(2).find("2 of 3 measured steps"), std::string::npos) << w.summary(2);
    w.add(30.0, 1e12);
    w.add(40.0, 1e12);
    EXPECT_TRUE(w.complete());
    EXPECT_EQ(w.measured(), 3);
    EXPECT_EQ(w.times(), (std::vector<double>{10.0, 20.0, 30.0}));
    EXPECT_DOUBLE_EQ(w.median_ms(), 20.0);
    EXPECT_NEAR(w.p95_ms(), 29.0, 1e-12);
    EXPECT_NEAR(w.cv(), 0.5, 1e-12);
    EXPECT_NEAR(w.tflops_per_gpu(2), 25.0, 1e-9);
    EXPECT_NE(w.summary(2).find("steps 3-5 of the run"), std::string::npos) << w.summary(2);
    TimedWindow f(0, 2);
    f.add(10.0, 1e12);
    f.add(10.0, 3e12);
    EXPECT_DOUBLE_EQ(f.mean_flops(), 2e12);
    EXPECT_FALSE(TimedWindow{}.active());
    EXPECT_THROW(TimedWindow::parse("8"), Error);
    EXPECT_THROW(TimedWindow::parse("8,0"), Error);
    EXPECT_THROW(TimedWindow::parse("-1,20"), Error);
    EXPECT_THROW(TimedWindow::parse("8,20x"), Error);
}

TEST(BenchStats, TableHasARowPerVariantAndTheDelta) {
    BenchResult a, b;
    a.variant = "step.eager", b.variant = "step.graph";
    a.step_ms = {100, 102, 101};
    b.step_ms = {95, 96, 94};
    summarize_times(a);
    summarize_times(b);
    a.peak_mem_mib = 1000, b.peak_mem_mib = 1012.5;
    const std::string t = bench_table({a, b});
    EXPECT_NE(t.find("step.eager"), std::string::npos);
    EXPECT_NE(t.find("step.graph"), std::string::npos);
    // (95 / 101 - 1) = -5.94%; graph faster; 12.5 MiB more in use.
    EXPECT_NE(t.find("delta step.graph vs step.eager: -5.94% median step time, +12.5 MiB in use "
                     "(faster)"),
              std::string::npos)
        << t;
    // Means 101 and 95: -6 ms; standard errors 1 / sqrt(3) each: sqrt(2 / 3) = 0.82.
    EXPECT_NE(t.find("; means -6.00 +- 0.82 ms"), std::string::npos) << t;
}

// The JSON line a run appends to the history: the recipe keys set on the command line and the
// optimizer's Newton-Schulz FLOPs beside the audited count, so A/B runs of one recipe stay apart.
TEST(BenchStats, JsonLineKeepsOverridesAndNewtonSchulzFlops) {
    BenchResult r;
    r.variant = "step.graph";
    r.step_ms = {10, 11, 12};
    summarize_times(r);
    r.flops = 3.0e14;
    r.newton_schulz_flops = 1.61e14;
    r.overrides = {"muon_ns_method=gram", "fp8_recipe=blockwise"};
    const auto j = nlohmann::json::parse(r.to_json());
    EXPECT_EQ(j.at("overrides"), nlohmann::json({"muon_ns_method=gram", "fp8_recipe=blockwise"}));
    EXPECT_DOUBLE_EQ(j.at("newton_schulz_flops_per_step").get<double>(), 1.61e14);
    EXPECT_DOUBLE_EQ(j.at("flops_per_step").get<double>(), 3.0e14);
    EXPECT_DOUBLE_EQ(j.at("median_ms").get<double>(), 11.0);
    EXPECT_DOUBLE_EQ(j.at("mean_ms").get<double>(), 11.0);
    EXPECT_NEAR(j.at("se_ms").get<double>(), 1.0 / std::sqrt(3.0), 1e-12);  // sd 1 over sqrt(3)
    EXPECT_FALSE(j.contains("env"));  // none set: no key, as the history's older lines
}

// The JSON line records the registered environment variables that are set (core/env.h), and
// only those.
TEST(BenchStats, JsonLineRecordsTheRegisteredEnvironment) {
    setenv("SPARSETRON_NUM_THREADS", "3", 1);
    setenv("SPARSETRON_NOT_REGISTERED", "1", 1);
    BenchResult r;
    r.step_ms = {10};
    summarize_times(r);
    r.env = registered_env();
    const auto j = nlohmann::json::parse(r.to_json());
    EXPECT_EQ(j.at("env").at("SPARSETRON_NUM_THREADS"), "3");
    EXPECT_FALSE(j.at("env").contains("SPARSETRON_NOT_REGISTERED"));
    unsetenv("SPARSETRON_NUM_THREADS");
    unsetenv("SPARSETRON_NOT_REGISTERED");
}

// `--variant NAME=SPEC`: the overrides as --set words or bare key=value words; an empty spec is
// the base recipe; malformed ones are refused with the text.
TEST(BenchStats, RecipeVariantsParseFromTheCommandLine) {
    const BenchVariant fp8 =
        parse_bench_variant("fp8=--set fp8_recipe=blockwise --set muon_ns_method=gram");
    EXPECT_EQ(fp8.name, "fp8");
    EXPECT_EQ(fp8.overrides,
              (std::vector<std::string>{"fp8_recipe=blockwise", "muon_ns_method=gram"}));
    const BenchVariant bare = parse_bench_variant("long=seq_length=8192  global_batch_size=2");
    EXPECT_EQ(bare.overrides, (std::vector<std::string>{"seq_length=8192", "global_batch_size=2"}));
    const BenchVariant base = parse_bench_variant("bf16=");
    EXPECT_EQ(base.name, "bf16");
    EXPECT_TRUE(base.overrides.empty());
    for (const char* bad : {"fp8", "=x=1", "fp8=--set fp8_recipe", "a/b=x=1"})
        EXPECT_THROW(parse_bench_variant(bad), Error) << bad;
}

// bench --data runs the trainer's whole steps: it refuses --forward-backward and needs a run
// directory, before anything is built.
TEST(BenchStats, DataRefusesForwardBackwardAndNeedsARunDirectory) {
    Recipe r;
    BenchOptions o;
    o.data = true;
    o.forward_backward_only = true;
    o.data_out = "unused";
    try {
        run_bench_data(r, o);
        ADD_FAILURE() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("--forward-backward"), std::string::npos) << e.what();
    }
    o.forward_backward_only = false;
    o.data_out.clear();
    try {
        run_bench(r, o);
        ADD_FAILURE() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("no run directory"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace sparsetron
