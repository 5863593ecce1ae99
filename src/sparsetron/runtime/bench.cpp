#include "sparsetron/runtime/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/runtime/device_engine.h"
#include "sparsetron/runtime/trainer.h"

namespace sparsetron {
namespace {

double percentile(std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    const double pos = q * double(v.size() - 1);
    const size_t i = size_t(pos);
    return i + 1 < v.size() ? v[i] + (pos - double(i)) * (v[i + 1] - v[i]) : v[i];
}

}  // namespace

BenchResult run_bench(const Recipe& recipe, const BenchOptions& o) {
    ST_CHECK(o.iters > 0 && o.warmup >= 0, "bench: --iters must be positive");
    auto tp = make_training_plan(recipe);
    tp->plan.allocate_only(Device::CPU, {MemClass::Parameters, MemClass::OptimizerState});
    tp->model->params().initialize(tp->plan, uint64_t(recipe.run.seed),
                                   recipe.model.init_method_std, recipe.model.num_layers);
    auto engine = make_cuda_engine(recipe, tp->model->params(), tp->plan, *tp->optimizer,
                                   tp->max_documents, tp->chunk_rows);
    engine->upload_state();
    // One synthetic document filling every slot of the micro-batch (the seed's THD benchmark).
    const int64_t slots = recipe.run.tokens_per_microbatch();
    MicroBatch mb(slots, tp->max_documents);
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
    BenchResult r;
    r.recipe = recipe.name;
    r.gpu = cuda_device_name();
    r.commit = o.commit;
    r.variant = o.forward_backward_only ? "forward_backward" : "step";
    for (int64_t it = 0; it < o.warmup + o.iters; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        engine->begin_step();
        for (int64_t i = 0; i < n_mb; ++i) engine->micro_batch(mb, sc);  // ends synchronized
        if (!o.forward_backward_only) engine->optimizer_step(recipe.run, 1 + it);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        if (it >= o.warmup) r.step_ms.push_back(ms);
    }
    r.median_ms = percentile(r.step_ms, 0.5);
    r.p95_ms = percentile(r.step_ms, 0.95);
    r.min_ms = *std::min_element(r.step_ms.begin(), r.step_ms.end());
    r.max_ms = *std::max_element(r.step_ms.begin(), r.step_ms.end());
    const FlopCount f = audited_flops(m, std::vector<int64_t>(size_t(n_mb), slots));
    r.flops = f.total;
    r.flops_terms = f.terms;
    r.tokens = f.tokens;
    r.tflops_per_gpu = f.total / (r.median_ms * 1e-3) / 1e12;
    r.tokens_per_s_per_gpu = double(f.tokens) / (r.median_ms * 1e-3);
    r.peak_mem_mib = double(device_memory_used()) / (1024.0 * 1024.0);
    r.planned_mem_mib = 0;
    return r;
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
    j["step_ms"] = step_ms;
    j["tflops_per_gpu"] = tflops_per_gpu;
    j["tokens_per_s_per_gpu"] = tokens_per_s_per_gpu;
    j["flops_per_step"] = flops;
    j["flops_convention"] = FlopCount::convention();
    j["flops_terms"] = nlohmann::json::array();
    for (auto& [name, v] : flops_terms) j["flops_terms"].push_back({name, v});
    j["tokens"] = tokens;
    j["peak_mem_mib"] = peak_mem_mib;
    return j.dump();
}

std::string BenchResult::table() const {
    std::ostringstream os;
    os << std::fixed << std::setprecision(1) << variant << ": median " << median_ms << " ms, p95 "
       << p95_ms << " ms (min " << min_ms << ", max " << max_ms << ", " << step_ms.size()
       << " iterations) | " << tflops_per_gpu << " audited TFLOPS | " << tokens_per_s_per_gpu
       << " tokens/s | device memory in use " << peak_mem_mib << " MiB";
    return os.str();
}

}  // namespace sparsetron
