#include "sparsetron/perf/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/env.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/optim/muon.h"
#include "sparsetron/parallel/layout/layout.h"
#include "sparsetron/parallel/layout/process_groups.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/runtime/step_engine.h"
#include "sparsetron/runtime/training_plan.h"

namespace sparsetron {
namespace {

double percentile(std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    const double pos = q * double(v.size() - 1);
    const size_t i = size_t(pos);
    return i + 1 < v.size() ? v[i] + (pos - double(i)) * (v[i + 1] - v[i]) : v[i];
}

}  // namespace

std::vector<int> abba_order(int variants, int64_t iters) {
    std::vector<int> order;
    for (int64_t round = 0; round < iters; ++round)
        for (int v = 0; v < variants; ++v) order.push_back(round % 2 ? variants - 1 - v : v);
    return order;
}

void summarize_times(BenchResult& r) {
    ST_CHECK(!r.step_ms.empty(), "bench: no timed iterations");
    r.median_ms = percentile(r.step_ms, 0.5);
    r.p95_ms = percentile(r.step_ms, 0.95);
    r.min_ms = *std::min_element(r.step_ms.begin(), r.step_ms.end());
    r.max_ms = *std::max_element(r.step_ms.begin(), r.step_ms.end());
    double mean = 0, var = 0;
    for (double x : r.step_ms) mean += x;
    mean /= double(r.step_ms.size());
    for (double x : r.step_ms) var += (x - mean) * (x - mean);
    const double n = double(r.step_ms.size());
    const double sd = n > 1 ? std::sqrt(var / (n - 1)) : 0.0;
    r.cv = mean > 0 ? sd / mean : 0.0;
    r.mean_ms = mean;
    r.se_ms = sd / std::sqrt(n);
}

std::vector<BenchResult> run_bench(const Recipe& recipe_in, const BenchOptions& o) {
    if (o.data) return run_bench_data(recipe_in, o);
    Recipe recipe = recipe_in;
    ST_CHECK(o.iters > 0 && o.warmup >= 0, "bench: --iters must be positive");
    ST_CHECK(!o.variants.empty(), "bench: no variants");
    for (const auto& v : o.variants)
        ST_CHECK(v == "eager" || v == "local" || v == "graph", "bench: unknown variant '", v,
                 "' (eager, local, graph)");
    check_fp8_recipe(recipe.run, Device::CUDA, recipe.model.fp8_output_proj);
    const int ranks = o.comm ? o.comm->size() : 1;
    ST_CHECK(recipe.run.world_size == ranks, "bench: world_size ", recipe.run.world_size, " but ",
             ranks, " processes were started");
    // Expert parallelism shards the routed experts: this rank's model holds its EP rank's.
    if (recipe.run.expert_model_parallel_size > 1)
        recipe.model.expert_parallel_rank =
            make_layout(recipe.run, ranks).ep_rank(o.comm ? o.comm->rank() : 0);
    auto tp = make_training_plan(recipe, Device::CUDA);
    const bool dynamic_cp = recipe.run.dynamic_context_parallel;
    std::unique_ptr<ProcessGroups> groups;
    if (recipe.run.expert_model_parallel_size > 1 || recipe.run.context_parallel_size > 1 ||
        (dynamic_cp && ranks > 1)) {
        ST_CHECK(o.comm, "bench: expert or context parallelism needs a launcher's processes");
        groups = std::make_unique<ProcessGroups>(
            ProcessGroups::create(*o.comm, make_layout(recipe.run, ranks)));
    }
    // Dynamic CP times its largest group: every rank (the largest power of two dividing them)
    // sharing one document of that many times max_seqlen_per_dp_cp_rank tokens, the seed's long
    // sample over its whole CP group; a group of one rank runs without CP.
    int cp_ranks = int(recipe.run.context_parallel_size);
    Comm* cp_group = nullptr;
    if (dynamic_cp) {
        ST_CHECK(recipe.run.max_seqlen_per_dp_cp_rank > 0,
                 "bench: dynamic_context_parallel needs max_seqlen_per_dp_cp_rank (tokens per "
                 "rank)");
        cp_ranks = make_layout(recipe.run, ranks).dynamic_cp_sizes(1).back();
        if (cp_ranks > 1) cp_group = &groups->dynamic(cp_ranks);
    }
    Communicators comms;
    comms.world = comms.stage = o.comm;
    if (groups)
        comms.expert = groups->ep.get(), comms.context = groups->cp.get(),
        comms.expert_data = groups->edp.get();
    auto engine = make_cuda_engine(recipe, *tp, comms);
    tp->params->initialize(tp->plan, uint64_t(recipe.run.seed), recipe.model.init_method_std,
                           recipe.model.num_layers);
    engine->upload_state();
    StepBench& bench = *engine->bench();
    // One synthetic document filling every slot of the micro-batch (the seed's THD benchmark).
    const int64_t slots = dynamic_cp ? cp_ranks * recipe.run.max_seqlen_per_dp_cp_rank
                                     : recipe.run.tokens_per_microbatch();
    MicroBatch mb(dynamic_cp ? tp->group_slots : slots,
                  dynamic_cp ? tp->group_max_documents : tp->max_documents);
    CounterRng rng(uint64_t(recipe.run.seed), 11);
    std::vector<int32_t> doc(slots);
    for (int64_t i = 0; i < slots; ++i)
        doc[i] = int32_t(rng.bits(uint64_t(i)) % uint64_t(recipe.model.vocab_size));
    ST_CHECK(mb.add_document(doc), "bench: the document does not fit the micro-batch");
    const ModelConfig& m = recipe.model;
    const int64_t n_mb = recipe.run.microbatches_per_step(), D = m.mtp_num_layers;
    const bool tv = m.mtp_loss_type == "e2e_tv";
    LossScales sc;
    sc.backward = true;
    sc.lm = 1.0 / double(mb.num_targets() * n_mb);
    for (int64_t k = 0; k < (tv ? (D > 0 ? 1 : 0) : D); ++k)
        sc.mtp.push_back(m.mtp_loss_scaling_factor / double(tv ? 1 : D) /
                         double(std::max<int64_t>(1, (slots - k - 2) * n_mb)));
    sc.indexer = sc.aux = 1.0 / double(n_mb);
    bench.stage_inputs(mb, sc, cp_group);
    const bool optimizer = !o.forward_backward_only;
    const std::string mode = o.forward_backward_only ? "forward_backward" : "step";
    const int V = int(o.variants.size());
    std::vector<BenchResult> results(V);
    int64_t step = 1;
    // Device memory in use after each of a variant's runs, the largest: the engine allocates
    // nothing inside a step and the libraries (NCCL, cuBLASLt, the graph's executable) keep what
    // they allocate, so the memory in use only grows and its value after a run is the
    // high-water mark so far. The graph's own memory shows as the difference, since eager runs
    // first.
    std::vector<double> mem(V, -1.0);
    auto run_one = [&](int v) {
        const std::string& mode = o.variants[size_t(v)];
        const BenchMode m = mode == "graph"   ? BenchMode::Graph
                            : mode == "local" ? BenchMode::Local
                                              : BenchMode::Eager;
        const double ms = bench.timed_step(m, optimizer, sc, n_mb, step++);
        mem[v] = std::max(mem[v], engine->memory_in_use_gib() * 1024.0);
        return ms;
    };
    for (int64_t w = 0; w < o.warmup; ++w)
        for (int v = 0; v < V; ++v) run_one(v);
    for (int v : abba_order(V, o.iters)) results[v].step_ms.push_back(run_one(v));
    const FlopCount f = audited_flops(m, std::vector<int64_t>(size_t(n_mb), slots));
    const double ns_flops =
        optimizer ? newton_schulz_count(*tp->params, m, recipe.run).chosen_flops : 0.0;
    for (int v = 0; v < V; ++v) {
        BenchResult& r = results[v];
        r.recipe = recipe.name;
        r.gpu = cuda_device_name();
        r.commit = o.commit;
        r.env = registered_env();
        // The eager single-variant run keeps the plain name the history has used.
        r.variant = V == 1 && o.variants[v] == "eager" ? mode : mode + "." + o.variants[v];
        summarize_times(r);
        r.flops = f.total;
        r.flops_terms = f.terms;
        r.tokens = f.tokens;
        // Under CP the ranks of a group share each micro-batch: a GPU does 1/cp of its work.
        const double cp = double(cp_ranks);
        r.tflops_per_gpu = f.total / cp / (r.median_ms * 1e-3) / 1e12;
        r.tokens_per_s_per_gpu = double(f.tokens) / cp / (r.median_ms * 1e-3);
        r.peak_mem_mib = mem[v];
        const std::vector<RankRange> across =
            ranges_across_ranks(o.comm, {r.median_ms, r.p95_ms, r.cv, r.peak_mem_mib});
        r.median_range = across[0], r.p95_range = across[1], r.cv_range = across[2];
        r.peak_mem_range = across[3];
        r.planned_mem_mib = bench.planned_memory_mib();
        r.gpus = ranks;
        r.cp_ranks = cp_ranks;
        r.newton_schulz_flops = ns_flops;
    }
    return results;
}

std::map<std::string, std::string> registered_env() {
    std::map<std::string, std::string> env;
    for (const EnvVar& v : env_vars())
        if (const auto value = env_value(v.name)) env[v.name] = *value;
    return env;
}

BenchVariant parse_bench_variant(const std::string& text) {
    const size_t eq = text.find('=');
    ST_CHECK(eq != std::string::npos && eq > 0, "--variant '", text,
             "': expected NAME=SPEC, e.g. fp8=\"--set fp8_recipe=blockwise\"");
    BenchVariant v{text.substr(0, eq), {}};
    ST_CHECK(v.name.find('/') == std::string::npos, "--variant '", text,
             "': a variant's name has no '/'");
    std::istringstream words(text.substr(eq + 1));
    std::string w;
    while (words >> w) {
        if (w == "--set" || w == "-s") continue;
        ST_CHECK(w.find('=') != std::string::npos && w.front() != '=', "--variant '", text, "': '",
                 w, "' is not key=value");
        v.overrides.push_back(w);
    }
    return v;
}

std::vector<BenchResult> run_bench_variants(const RecipeLoader& load,
                                            const std::vector<std::string>& base_overrides,
                                            const std::vector<BenchVariant>& variants,
                                            int64_t rounds, const BenchOptions& o) {
    if (variants.empty()) {
        std::vector<BenchResult> res = run_bench(load(base_overrides), o);
        for (BenchResult& r : res) r.overrides = base_overrides;
        return res;
    }
    ST_CHECK(rounds > 0, "bench: --rounds must be positive");
    const int V = int(variants.size()), M = int(o.variants.size());
    std::vector<BenchResult> pooled(size_t(V * M));
    for (int v : abba_order(V, rounds)) {
        std::vector<std::string> sets = base_overrides;
        sets.insert(sets.end(), variants[size_t(v)].overrides.begin(),
                    variants[size_t(v)].overrides.end());
        std::vector<BenchResult> res = run_bench(load(sets), o);
        for (int m = 0; m < M; ++m) {
            BenchResult& p = pooled[size_t(v * M + m)];
            const std::vector<double> times = p.step_ms;
            p = res[size_t(m)];
            p.step_ms.insert(p.step_ms.begin(), times.begin(), times.end());
            p.variant = variants[size_t(v)].name + "/" + res[size_t(m)].variant;
            p.overrides = sets;
        }
    }
    for (BenchResult& p : pooled) {
        // Throughput from the pooled median: the copied figures are the last round's.
        const double last_median = p.median_ms;
        summarize_times(p);
        p.tflops_per_gpu *= last_median / p.median_ms;
        p.tokens_per_s_per_gpu *= last_median / p.median_ms;
    }
    return pooled;
}

std::string BenchResult::to_json() const {
    nlohmann::json j;
    j["recipe"] = recipe;
    j["gpu"] = gpu;
    j["commit"] = commit;
    j["variant"] = variant;
    j["median_ms"] = median_ms;
    j["p95_ms"] = p95_ms;
    j["min_ms"] = min_ms;
    j["max_ms"] = max_ms;
    j["cv"] = cv;
    j["mean_ms"] = mean_ms;
    j["se_ms"] = se_ms;
    j["timing"] = timing;
    j["step_ms"] = step_ms;
    j["tflops_per_gpu"] = tflops_per_gpu;
    j["tokens_per_s_per_gpu"] = tokens_per_s_per_gpu;
    j["flops_per_step"] = flops;
    j["flops_convention"] = FlopCount::convention();
    j["flops_terms"] = nlohmann::json::array();
    for (auto& [name, v] : flops_terms) j["flops_terms"].push_back({name, v});
    j["tokens"] = tokens;
    j["peak_mem_mib"] = peak_mem_mib;
    const auto range = [](const RankRange& r) { return nlohmann::json::array({r.min, r.max}); };
    j["median_ms_range"] = range(median_range);
    j["p95_ms_range"] = range(p95_range);
    j["cv_range"] = range(cv_range);
    j["peak_mem_mib_range"] = range(peak_mem_range);
    j["planned_mem_mib"] = planned_mem_mib;
    j["gpus"] = gpus;
    if (cp_ranks > 1) j["cp_ranks"] = cp_ranks;
    j["newton_schulz_flops_per_step"] = newton_schulz_flops;
    j["overrides"] = overrides;
    if (!env.empty()) j["env"] = env;
    return j.dump();
}

std::string BenchResult::table() const {
    return bench_table({*this});
}

std::string bench_table(const std::vector<BenchResult>& rs) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(1);
    os << std::left << std::setw(26) << "variant" << std::right << std::setw(11) << "median ms"
       << std::setw(10) << "p95 ms" << std::setw(10) << "min ms" << std::setw(10) << "max ms"
       << std::setw(8) << "CV %" << std::setw(10) << "TFLOPS" << std::setw(12) << "tokens/s"
       << std::setw(13) << "in use MiB" << std::setw(13) << "planned MiB"
       << "\n";
    for (const auto& r : rs)
        os << std::left << std::setw(26) << r.variant << std::right << std::setw(11) << r.median_ms
           << std::setw(10) << r.p95_ms << std::setw(10) << r.min_ms << std::setw(10) << r.max_ms
           << std::setw(8) << std::setprecision(2) << 100.0 * r.cv << std::setprecision(1)
           << std::setw(10) << r.tflops_per_gpu << std::setw(12) << r.tokens_per_s_per_gpu
           << std::setw(13) << r.peak_mem_mib << std::setw(13) << r.planned_mem_mib << "\n";
    // Several ranks: each figure's range over them (this table is rank 0's).
    for (const auto& r : rs)
        if (r.gpus > 1)
            os << "  " << r.variant << " across " << r.gpus << " ranks: median "
               << r.median_range.min << "-" << r.median_range.max << " ms, p95 " << r.p95_range.min
               << "-" << r.p95_range.max << " ms, CV " << std::setprecision(2)
               << 100.0 * r.cv_range.min << "-" << 100.0 * r.cv_range.max << " %"
               << std::setprecision(1) << ", in use " << r.peak_mem_range.min << "-"
               << r.peak_mem_range.max << " MiB\n";
    for (size_t i = 1; i < rs.size(); ++i) {
        const double d = 100.0 * (rs[i].median_ms / rs[0].median_ms - 1.0);
        // The means' difference and its standard error (the two in quadrature): a difference
        // within ~2 of them is the replays' spread, not the variants'.
        const double dm = rs[i].mean_ms - rs[0].mean_ms;
        const double se = std::hypot(rs[i].se_ms, rs[0].se_ms);
        os << "delta " << rs[i].variant << " vs " << rs[0].variant << ": " << std::showpos
           << std::setprecision(2) << d << "% median step time, " << std::setprecision(1)
           << rs[i].peak_mem_mib - rs[0].peak_mem_mib << " MiB in use" << std::noshowpos << " ("
           << (d <= 0 ? "faster" : "slower") << "); means " << std::showpos << std::setprecision(2)
           << dm << std::noshowpos << " +- " << se << " ms\n";
    }
    std::string out = os.str();
    if (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
}

}  // namespace sparsetron
