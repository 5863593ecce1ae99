// `sparsetron report`: one self-contained HTML page of the benchmark history's plots.
#include <cstdio>
#include <memory>

#include "command.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/perf/report.h"

namespace sparsetron::cli {

Run add_report(CLI::App& app) {
    struct Options {
        std::vector<std::string> histories;
        std::string out, recipe;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("report", "One self-contained HTML page from bench history");
    c->add_option("--history", o->histories, "Bench history JSONL file, repeatable")->required();
    c->add_option("--out", o->out, "Output HTML file")->required();
    c->add_option("--recipe", o->recipe,
                  "Recipe whose FLOPs breakdown to draw when no record carries one");
    return [o] {
        ReportInput in;
        in.history_files = o->histories;
        if (!o->recipe.empty()) {
            const Recipe r = load_recipe(o->recipe, {});
            in.flops_terms = audited_flops(r.model, step_documents(r, "")).terms;
            in.flops_title = r.name;
        }
        const int n = write_report(in, o->out);
        std::printf("report: %d records -> %s\n", n, o->out.c_str());
        return 0;
    };
}

}  // namespace sparsetron::cli
