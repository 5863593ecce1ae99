// `sparsetron report`: one self-contained HTML page of the benchmark history's plots.
#include <cstdio>
#include <memory>

#include "command.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/perf/report.h"
#include "sparsetron/perf/run_report.h"

namespace sparsetron::cli {

Run add_report(CLI::App& app) {
    struct Options {
        std::vector<std::string> histories, runs;
        std::string out, recipe;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand(
        "report", "One self-contained HTML page from bench history or training runs");
    c->add_option("--history", o->histories, "Bench history JSONL file, repeatable");
    c->add_option("--run", o->runs,
                  "Training run directory (its metrics.jsonl), repeatable: loss, validation, "
                  "MTP, indexer, grad norm, lr and throughput curves, expert-load heat map");
    c->add_option("--out", o->out, "Output HTML file")->required();
    c->add_option("--recipe", o->recipe,
                  "Recipe whose FLOPs breakdown to draw when no record carries one");
    return [o] {
        ST_CHECK(o->histories.empty() != o->runs.empty(),
                 "report: give --history FILE or --run DIR (one kind)");
        if (!o->runs.empty()) {
            const int n = write_run_report(o->runs, o->out);
            std::printf("report: %d steps -> %s\n", n, o->out.c_str());
            return 0;
        }
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
