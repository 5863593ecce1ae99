#include "sparsetron/perf/bench_plan.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "sparsetron/core/error.h"

namespace sparsetron {

std::string run_bench_plan(const BenchPlan& plan, const RecipeLoader& load,
                           const BenchOptions& options) {
    ST_CHECK(!plan.rows.empty(), plan.path, ": the plan has no rows");
    nlohmann::ordered_json record;
    record["plan"] = plan.path;
    record["recipe"] = plan.recipe;
    record["commit"] = options.commit;
    record["timing"] = "cuda_events";
    record["warmup"] = plan.warmup;
    record["iters"] = plan.iters;
    record["rows"] = nlohmann::json::array();
    for (const BenchPlanRow& row : plan.rows) {
        const std::vector<int64_t> lengths =
            row.lengths.empty() ? std::vector<int64_t>{0} : row.lengths;
        for (int64_t length : lengths) {
            std::vector<std::string> sets = row.overrides;
            if (length > 0) sets.push_back(cat("seq_length=", length));
            BenchOptions o = options;
            o.warmup = plan.warmup;
            o.iters = plan.iters;
            o.variants = row.variants;
            o.forward_backward_only = row.forward_backward;
            o.data = row.data;
            if (row.data)  // a run directory per row
                o.data_out = default_bench_data_out(
                    plan.recipe, cat("-", row.name, length > 0 ? cat("-", length) : std::string()));
            const std::vector<BenchResult> results = run_bench(load(sets), o);
            const std::string title = length > 0 ? cat(row.name, " at ", length) : row.name;
            std::printf("== %s\n%s\n", title.c_str(), bench_table(results).c_str());
            std::fflush(stdout);
            nlohmann::ordered_json r;
            r["name"] = row.name;
            if (length > 0) r["length"] = length;
            r["overrides"] = sets;
            if (row.data) r["data"] = true;
            r["results"] = nlohmann::json::array();
            for (const BenchResult& b : results) {
                BenchResult named = b;
                named.overrides = sets;
                r["results"].push_back(nlohmann::ordered_json::parse(named.to_json()));
            }
            if (!record.contains("gpu") && !results.empty()) record["gpu"] = results.front().gpu;
            record["rows"].push_back(r);
        }
    }
    return record.dump();
}

}  // namespace sparsetron
