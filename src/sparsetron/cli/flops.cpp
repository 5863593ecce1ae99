// `sparsetron flops`: the audited FLOPs of one step of a recipe (SPEC §8), and Megatron's stock
// formula beside it.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
#include "sparsetron/core/error.h"
#include "sparsetron/perf/flops.h"

namespace sparsetron::cli {
namespace {

int flops(const std::string& recipe_path, const std::vector<std::string>& sets,
          const std::string& lengths, const std::string& convention, const JsonOutput& json) {
    ST_CHECK(convention == "audited" || convention == "megatron",
             "--convention must be audited or megatron, got '", convention, "'");
    const Recipe r = load_recipe(recipe_path, sets);
    const std::vector<int64_t> docs = step_documents(r, lengths);
    const FlopCount f = audited_flops(r.model, docs);
    const FlopCount meg = megatron_flops(r.model, docs);
    if (json.wanted()) {
        nlohmann::json j;
        j["total_flops"] = f.total;
        j["tokens"] = f.tokens;
        j["documents"] = docs.size();
        j["convention"] = FlopCount::convention();
        for (auto& [name, v] : f.terms) j["terms"][name] = v;
        if (convention == "megatron") {
            j["megatron"]["total_flops"] = meg.total;
            for (auto& [name, v] : meg.terms) j["megatron"]["terms"][name] = v;
        }
        json.write(j.dump());
        if (json.to_stdout()) return 0;
    }
    std::printf("FLOPs per step of %s: %zu documents, %lld tokens\nconvention: %s\n\n",
                r.name.c_str(), docs.size(), static_cast<long long>(f.tokens),
                FlopCount::convention());
    const bool both = convention == "megatron";
    std::printf("%-24s %16s %8s%s\n", "term", "audited TFLOP", "share",
                both ? "   Megatron stock TFLOP" : "");
    for (size_t i = 0; i < f.terms.size(); ++i) {
        std::printf("%-24s %16.1f %7.2f%%", f.terms[i].first.c_str(), f.terms[i].second / 1e12,
                    100.0 * f.terms[i].second / f.total);
        if (both) std::printf("   %18.1f", meg.terms[i].second / 1e12);
        std::printf("\n");
    }
    std::printf("%-24s %16.1f %8s", "total", f.total / 1e12, "");
    if (both) std::printf("   %18.1f", meg.total / 1e12);
    std::printf("\n= %.4f PFLOP/step%s\n", f.total / 1e15,
                both ? cat(" (Megatron stock formula: ", meg.total / 1e15, ")").c_str() : "");
    return 0;
}

}  // namespace

Run add_flops(CLI::App& app) {
    struct Options {
        std::string recipe, doc_lengths, convention = "audited";
        std::vector<std::string> sets;
        JsonOutput json;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("flops", "Audited model FLOPs per step of a recipe (SPEC 8)");
    c->add_option("--recipe", o->recipe,
                  "Recipe YAML, or a recipe and its overlays: base.yaml,overlay.yaml")
        ->required();
    c->add_option("--set", o->sets, "Override a recipe key (key=value), repeatable");
    c->add_option("--doc-lengths", o->doc_lengths,
                  "Comma-separated document lengths of one step (default: global_batch_size "
                  "documents of seq_length)");
    c->add_option("--convention", o->convention,
                  "audited (default) or megatron (also print Megatron's stock formula)");
    add_json_output(c, o->json, "The count (total_flops, terms, convention, tokens)");
    return [o] { return flops(o->recipe, o->sets, o->doc_lengths, o->convention, o->json); };
}

}  // namespace sparsetron::cli
