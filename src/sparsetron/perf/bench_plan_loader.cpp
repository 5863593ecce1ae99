// load_bench_plan (bench_plan.h): reads YAML, so it is built into the static recipe library with
// the YAML reader, not into the engine library.
#include <yaml-cpp/yaml.h>

#include "sparsetron/core/error.h"
#include "sparsetron/perf/bench_plan.h"

namespace sparsetron {
namespace {

template <typename T>
T scalar(const YAML::Node& n, const std::string& where) {
    try {
        return n.as<T>();
    } catch (const YAML::Exception&) {
        throw Error(cat(where, ": expected a ", sizeof(T) == 1 ? "boolean" : "value", ", got '",
                        n.as<std::string>(""), "'"));
    }
}

template <typename T>
std::vector<T> list(const YAML::Node& n, const std::string& where) {
    ST_CHECK(n.IsSequence(), where, ": expected a list ([a, b, ...])");
    std::vector<T> out;
    for (size_t i = 0; i < n.size(); ++i) out.push_back(scalar<T>(n[i], cat(where, "[", i, "]")));
    return out;
}

}  // namespace

BenchPlan load_bench_plan(const std::string& path) {
    YAML::Node root;
    try {
        root = YAML::LoadFile(path);
    } catch (const YAML::Exception& e) {
        throw Error(cat("bench plan '", path, "': ", e.what()));
    }
    ST_CHECK(root.IsMap(), "bench plan '", path, "': expected a mapping with recipe and rows");
    BenchPlan plan;
    plan.path = path;
    for (const auto& kv : root) {
        const std::string key = kv.first.as<std::string>();
        const std::string where = cat(path, ": ", key);
        if (key == "recipe")
            plan.recipe = scalar<std::string>(kv.second, where);
        else if (key == "warmup")
            plan.warmup = scalar<int64_t>(kv.second, where);
        else if (key == "iters")
            plan.iters = scalar<int64_t>(kv.second, where);
        else if (key != "rows")
            throw Error(cat(path, ": unknown key '", key, "' (recipe, warmup, iters, rows)"));
    }
    ST_CHECK(!plan.recipe.empty(), path, ": no recipe");
    ST_CHECK(plan.warmup >= 0 && plan.iters > 0, path, ": warmup >= 0 and iters > 0");
    const YAML::Node rows = root["rows"];
    ST_CHECK(rows && rows.IsSequence() && rows.size() > 0, path, ": rows: a list of rows");
    for (size_t i = 0; i < rows.size(); ++i) {
        const YAML::Node r = rows[i];
        const std::string at = cat(path, ": rows[", i, "]");
        ST_CHECK(r.IsMap(), at,
                 ": expected a mapping (name, set, forward_backward, lengths, "
                 "variants, data)");
        BenchPlanRow row;
        for (const auto& kv : r) {
            const std::string key = kv.first.as<std::string>();
            const std::string where = cat(at, ".", key);
            if (key == "name")
                row.name = scalar<std::string>(kv.second, where);
            else if (key == "set")
                row.overrides = list<std::string>(kv.second, where);
            else if (key == "forward_backward")
                row.forward_backward = scalar<bool>(kv.second, where);
            else if (key == "lengths")
                row.lengths = list<int64_t>(kv.second, where);
            else if (key == "variants")
                row.variants = list<std::string>(kv.second, where);
            else if (key == "data")
                row.data = scalar<bool>(kv.second, where);
            else
                throw Error(cat(at, ": unknown key '", key,
                                "' (name, set, forward_backward, lengths, variants, data)"));
        }
        ST_CHECK(!row.name.empty(), at, ": no name");
        for (const std::string& s : row.overrides)
            ST_CHECK(s.find('=') != std::string::npos, at, ".set: '", s, "' is not key=value");
        for (int64_t l : row.lengths) ST_CHECK(l > 0, at, ".lengths: ", l, " is not positive");
        ST_CHECK(!row.data || !row.forward_backward, at,
                 ": data times the trainer's whole steps (no forward_backward)");
        for (const std::string& v : row.variants)
            ST_CHECK(v == "eager" || v == "local" || v == "graph", at, ".variants: '", v,
                     "' (eager, local, graph)");
        plan.rows.push_back(row);
    }
    return plan;
}

}  // namespace sparsetron
