// `sparsetron`: the command line. Each subcommand is a small function over the engine library.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "progress.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/parallel.h"
#include "sparsetron/data/byte_tokenizer.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/parallel/comm.h"
#include "sparsetron/parallel/launch_env.h"
#include "sparsetron/parallel/layout.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/perf/report.h"
#include "sparsetron/runtime/bench.h"
#include "sparsetron/runtime/device_engine.h"
#include "sparsetron/runtime/exchange_bench.h"
#if SPARSETRON_MPI
#include "sparsetron/parallel/mpi/mpi_comm.h"
#endif
#include "sparsetron/runtime/evaluate.h"
#include "sparsetron/runtime/trainer.h"

namespace fs = std::filesystem;
using namespace sparsetron;

namespace {

Device parse_device(const std::string& d) {
    if (d.empty()) return Device::CPU;  // CUDA becomes the default once its training step exists
    if (d == "cpu") return Device::CPU;
    if (d == "cuda") return Device::CUDA;
    throw Error(cat("--device must be cpu or cuda, got '", d, "'"));
}

// metrics.jsonl: kept lines up to `keep_through` (a resumed run continues the file).
void trim_metrics(const fs::path& path, int64_t keep_through) {
    if (!fs::exists(path)) return;
    std::ifstream in(path);
    std::string kept, line;
    while (std::getline(in, line)) {
        try {
            if (nlohmann::json::parse(line).at("step").get<int64_t>() <= keep_through)
                kept += line + "\n";
        } catch (const std::exception&) {
        }
    }
    in.close();
    std::ofstream(path, std::ios::trunc) << kept;
}

// "a,b,c" -> {"a", "b", "c"} (empty items dropped).
std::vector<std::string> split_list(const std::string& text) {
    std::vector<std::string> items;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ','))
        if (!item.empty()) items.push_back(item);
    return items;
}

// Documents of one step: --doc-lengths, else one seq_length document per sample of the global
// batch (the seed's THD benchmark packing).
std::vector<int64_t> step_documents(const Recipe& r, const std::string& lengths) {
    std::vector<int64_t> docs;
    if (!lengths.empty()) {
        std::stringstream ss(lengths);
        std::string item;
        while (std::getline(ss, item, ',')) {
            try {
                size_t used = 0;
                const long long v = std::stoll(item, &used);
                ST_CHECK(used == item.size() && v > 0, "");
                docs.push_back(v);
            } catch (const std::exception&) {
                throw Error(cat("--doc-lengths: '", item, "' is not a positive integer"));
            }
        }
        ST_CHECK(!docs.empty(), "--doc-lengths: no lengths given");
        return docs;
    }
    return std::vector<int64_t>(size_t(r.run.global_batch_size), r.run.seq_length);
}

int cmd_flops(const std::string& recipe_path, const std::vector<std::string>& sets,
              const std::string& lengths, const std::string& convention, bool json) {
    ST_CHECK(convention == "audited" || convention == "megatron",
             "--convention must be audited or megatron, got '", convention, "'");
    const Recipe r = load_recipe(recipe_path, sets);
    const std::vector<int64_t> docs = step_documents(r, lengths);
    const FlopCount f = audited_flops(r.model, docs);
    const FlopCount meg = megatron_flops(r.model, docs);
    if (json) {
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
        std::printf("%s\n", j.dump(1).c_str());
        return 0;
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

// Set by main() when this binary runs as one rank of an MPI job (sparsetron-mpi under mpirun), or
// by the CUDA commands when a launcher started several processes (NCCL, one GPU each).
Comm* g_comm = nullptr;
std::unique_ptr<Comm> g_nccl;

// Under a launcher (mpirun, torchrun, srun) with more than one process, `--device cuda` runs
// connect over NCCL; a CPU run in this binary stays a single process per launch.
void connect_gpus_if_launched(Device device) {
    if (g_comm || device != Device::CUDA) return;
    const LaunchEnv env = detect_launch_env();
    if (env.world <= 1) return;
    g_nccl = make_nccl_comm(env);
    g_comm = g_nccl.get();
}

// The optimizer's Newton-Schulz work, which the audited count (sparsetron flops) leaves out.
void print_newton_schulz(const NewtonSchulzCount& ns, const RunConfig& r) {
    if (ns.matrices == 0) return;
    auto flops = [](double f) {
        char b[32];
        std::snprintf(b, sizeof b, f >= 1e12 ? "%.1f TFLOP" : "%.2f GFLOP",
                      f >= 1e12 ? f / 1e12 : f / 1e9);
        return std::string(b);
    };
    std::printf("optimizer: muon | Newton-Schulz %s per step over %lld matrices",
                flops(ns.chosen_flops).c_str(), static_cast<long long>(ns.matrices));
    if (r.muon_ns_method == "gram")
        std::printf(", %lld in the Gram form (standard form: %s)",
                    static_cast<long long>(ns.gram_matrices), flops(ns.standard_flops).c_str());
    std::printf(" | not in the audited count\n");
}

int cmd_train(const std::string& recipe_path, const std::vector<std::string>& sets,
              const std::string& out_arg, const std::string& resume, const std::string& device,
              bool quiet, bool no_save) {
    Recipe recipe;
    if (recipe_path.empty() && !resume.empty()) {
        // Resuming without --recipe: continue with the recipe stored in the checkpoint.
        std::string ckpt = resolve_checkpoint(resume);
        recipe = Recipe{};
        for (const auto& s : parse_recipe_yaml(load_checkpoint_recipe(ckpt), ckpt + "/recipe.yaml"))
            recipe.apply(s);
        for (const auto& o : sets) recipe.apply(parse_override(o));
        try {
            recipe.validate();
        } catch (const Error& e) {
            // Most often a checkpoint of another layout resumed on fewer processes.
            throw Error(cat(e.what(), "\n(the recipe is the checkpoint's, ", ckpt,
                            "/recipe.yaml: override its layout with --set, e.g. --set world_size=1 "
                            "--set expert_model_parallel_size=1 --set context_parallel_size=1 "
                            "to resume on one process)"));
        }
        recipe.name = ckpt + "/recipe.yaml";
    } else {
        recipe = load_recipe(recipe_path, sets);
    }
    std::string out = out_arg;
    if (out.empty())
        out = (fs::path("runs") / (recipe_path.empty() ? "tiny" : fs::path(recipe_path).stem()))
                  .string();
    connect_gpus_if_launched(parse_device(device));
    TrainOptions opts{out, resume, parse_device(device), !no_save, g_comm};
    Trainer trainer(recipe, opts);
    // Rank 0 reports and writes the metrics; the other ranks train silently.
    if (trainer.world_rank() != 0) {
        trainer.run();
        return 0;
    }
    const auto& r = trainer.recipe().run;
    const auto& params = trainer.params();
    const std::string dp =
        trainer.world_size() > 1 && g_comm
            ? cat(" | ", trainer.world_size(), " ", g_comm->name(), " ranks: data parallel ",
                  trainer.data_parallel_size(),
                  r.context_parallel_size > 1 ? cat(" x context parallel ", r.context_parallel_size)
                                              : std::string(),
                  r.expert_model_parallel_size > 1
                      ? cat(", expert parallel ", r.expert_model_parallel_size)
                      : std::string())
            : std::string();
    std::printf("sparsetron %s | recipe %s | device %s%s\n", SPARSETRON_VERSION,
                recipe.name.c_str(), trainer.device_description().c_str(), dp.c_str());
    std::printf("model: %lld layers, hidden %lld, %lld heads, vocab %lld | %.2fM parameters\n",
                static_cast<long long>(recipe.model.num_layers),
                static_cast<long long>(recipe.model.hidden_size),
                static_cast<long long>(recipe.model.num_attention_heads),
                static_cast<long long>(recipe.model.vocab_size), params.total_numel() / 1e6);
    std::printf("batch: %lld micro-batches%s x %lld token slots | %s %s | output %s\n",
                static_cast<long long>(r.microbatches_per_step()),
                trainer.data_parallel_size() > 1
                    ? cat(" per data-parallel rank x ", trainer.data_parallel_size()).c_str()
                    : "",
                static_cast<long long>(r.tokens_per_microbatch()),
                opts.device == Device::CUDA ? "host mirror (planned, all classes)" : "memory plan",
                format_bytes(double(trainer.plan().total_bytes())).c_str(), out.c_str());
    print_newton_schulz(newton_schulz_count(params, trainer.recipe().model, r), r);
    if (trainer.iteration() > 0)
        std::printf("resumed at iteration %lld\n", static_cast<long long>(trainer.iteration()));
    std::fflush(stdout);

    fs::path metrics_path = fs::path(out) / "metrics.jsonl";
    if (trainer.iteration() > 0)
        trim_metrics(metrics_path, trainer.iteration());
    else
        fs::remove(metrics_path);
    std::ofstream metrics(metrics_path, std::ios::app);
    ST_CHECK(metrics.good(), "cannot write '", metrics_path.string(), "'");
    cli::Progress progress(trainer.iteration(), r.train_iters, r.log_interval, quiet);
    double first_loss = -1, last_loss = -1;
    StepMetrics first_metrics, last_metrics;
    int64_t first_step = 0;
    trainer.run([&](const StepMetrics& m) {
        metrics << m.to_json() << "\n";
        metrics.flush();
        if (first_loss < 0) first_loss = m.lm_loss, first_step = m.step, first_metrics = m;
        last_loss = m.lm_loss;
        last_metrics = m;
        progress.update(m);
    });
    progress.finish();
    if (first_loss >= 0) {
        std::printf("lm_loss %.4f -> %.4f over steps %lld..%lld\n", first_loss, last_loss,
                    static_cast<long long>(first_step), static_cast<long long>(r.train_iters));
        if (last_metrics.mtp_loss > 0)
            std::printf("mtp_loss %.4f -> %.4f, indexer_loss %.3e -> %.3e\n",
                        first_metrics.mtp_loss, last_metrics.mtp_loss, first_metrics.indexer_loss,
                        last_metrics.indexer_loss);
    }
    if (!no_save)
        std::printf("checkpoint: %s\n", resolve_checkpoint(trainer.checkpoint_dir()).c_str());
    std::printf("metrics: %s\n", metrics_path.c_str());
    return 0;
}

int cmd_eval(const std::string& model, const std::string& tokens, bool json) {
    EvalResult r = evaluate(model, read_token_documents(tokens));
    if (json) {
        nlohmann::ordered_json j;
        j["lm_loss"] = r.lm_loss;
        j["targets"] = r.targets;
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("lm_loss %.6f over %lld targets in %lld documents (perplexity %.3f)\n",
                    r.lm_loss, static_cast<long long>(r.targets),
                    static_cast<long long>(r.documents), std::exp(r.lm_loss));
    }
    return 0;
}

int cmd_plan(const std::string& recipe_path, const std::vector<std::string>& sets,
             const std::string& device) {
    Recipe recipe = load_recipe(recipe_path, sets);
    auto tp = make_training_plan(recipe);
    const auto& params = tp->model->params();
    if (recipe.run.world_size > 1) {
        // The layout the recipe asks for; the plans below are of one process of it.
        const ParallelLayout layout = make_layout(recipe.run, int(recipe.run.world_size));
        std::printf(
            "parallel layout: %s\nnote: the plan below is EP rank 0's (every EP rank holds "
            "as many experts); expert parallelism adds its worst-case receive rows, and "
            "use_distributed_optimizer would drop the AdamW moments a rank does not own "
            "(not shown: they depend on the rank; docs/parallel.md)\n",
            layout.describe().c_str());
    }
    if (parse_device(device) == Device::CUDA) {
        size_t total = 0;
        const std::string table =
            format_cuda_plan(recipe, params, tp->max_documents, tp->chunk_rows, &total);
        std::printf(
            "device memory plan for %s (per GPU; bf16 activations and weight copies, fp32 "
            "masters, gradients and optimizer state)\n",
            recipe.name.c_str());
        std::printf(
            "micro-batch: %lld token slots, at most %lld documents; loss chunk %lld "
            "rows\n\n%s",
            static_cast<long long>(recipe.run.tokens_per_microbatch()),
            static_cast<long long>(tp->max_documents), static_cast<long long>(tp->chunk_rows),
            table.c_str());
        std::printf("plus the CUDA context and cuBLASLt's 64 MiB workspace (not planned)\n");
        print_newton_schulz(newton_schulz_count(params, recipe.model, recipe.run), recipe.run);
        return 0;
    }
    std::printf("memory plan for %s (per process; fp32 CPU training)\n", recipe.name.c_str());
    std::printf("parameters: %lld tensors, %.3fM elements\n",
                static_cast<long long>(params.params().size()), params.total_numel() / 1e6);
    std::printf("micro-batch: %lld token slots, at most %lld documents; loss chunk %lld rows\n",
                static_cast<long long>(recipe.run.tokens_per_microbatch()),
                static_cast<long long>(tp->max_documents), static_cast<long long>(tp->chunk_rows));
    if (tp->model->context_parallel())
        std::printf(
            "context parallelism: this rank computes %lld rows of micro-batches of %lld "
            "key rows\n",
            static_cast<long long>(tp->model->tokens()),
            static_cast<long long>(tp->model->key_tokens()));
    std::printf("\n");
    std::printf("%s\n", tp->plan.format().c_str());
    std::printf("%s", tp->optimizer->describe(tp->plan).c_str());
    print_newton_schulz(newton_schulz_count(params, recipe.model, recipe.run), recipe.run);
    return 0;
}

int cmd_preprocess(const std::vector<std::string>& inputs, const std::string& output,
                   const std::string& json_key) {
    PreprocessStats s = preprocess_text(inputs, output, json_key);
    std::printf("wrote %s.bin / %s.idx: %lld documents, %lld tokens (byte-level, EOD = %d)\n",
                output.c_str(), output.c_str(), static_cast<long long>(s.documents),
                static_cast<long long>(s.tokens), ByteTokenizer::kEod);
    return 0;
}

int cmd_keys() {
    std::printf(
        "# Recipe keys (Megatron-LM names) with their defaults (the built-in tiny recipe)\n");
    std::printf("%s", builtin_tiny_recipe().to_yaml().c_str());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
#if SPARSETRON_MPI
    // Under mpirun (or another launcher) this binary is one rank of a data-parallel job.
    std::unique_ptr<MpiComm> mpi;
    try {
        if (detect_launch_env().world > 1) {
            mpi = std::make_unique<MpiComm>(&argc, &argv);
            g_comm = mpi.get();
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
#endif
    CLI::App app{
        "Sparsetron: a C++20/CUDA training engine for GLM-5-family sparse-attention MoE "
        "models.\nRun `sparsetron train` to train the built-in tiny recipe on the bundled "
        "corpus.",
        "sparsetron"};
    app.require_subcommand(1);
    app.set_version_flag("--version", SPARSETRON_VERSION);

    std::string recipe, out, resume, device, model, tokens, output, json_key = "text";
    std::vector<std::string> sets, inputs;
    bool quiet = false, json = false, no_save = false;

    auto* train = app.add_subcommand("train",
                                     "Train a model (default: the tiny recipe on the "
                                     "bundled corpus, on CPU)");
    train->add_option("--recipe,-r", recipe, "Recipe YAML (Megatron keys); default: built-in tiny")
        ->check(CLI::ExistingFile);
    train->add_option("--set,-s", sets, "Override a recipe key: --set key=value (repeatable)");
    train->add_option("--out,-o", out,
                      "Output directory for metrics.jsonl and checkpoints "
                      "(default: runs/<recipe name>)");
    train->add_option("--resume", resume,
                      "Resume from a checkpoint or a save directory (its "
                      "latest checkpoint); uses its recipe unless --recipe");
    train->add_option("--device", device, "cpu or cuda (default: cpu)");
    train->add_flag("--quiet,-q", quiet, "No progress output");
    train->add_flag("--no-save", no_save, "Write no checkpoint (metrics only)");

    auto* eval = app.add_subcommand("eval", "Mean next-token loss of a model on token documents");
    eval->add_option("--model,-m", model, "Checkpoint, save directory, or HF directory")
        ->required();
    eval->add_option("--tokens,-t", tokens, "File with one document per line as token ids")
        ->required();
    eval->add_flag("--json", json, "Print {\"lm_loss\": ..., \"targets\": ...}");

    auto* plan = app.add_subcommand("plan", "Print the memory plan of a recipe per memory class");
    plan->add_option("--recipe,-r", recipe, "Recipe YAML (default: built-in tiny)")
        ->check(CLI::ExistingFile);
    plan->add_option("--set,-s", sets, "Override a recipe key: --set key=value (repeatable)");
    std::string plan_device = "cpu";
    plan->add_option("--device", plan_device, "cpu (default) or cuda: the plan of that backend");

    auto* pre = app.add_subcommand("preprocess",
                                   "Text or JSONL -> Megatron .bin/.idx "
                                   "(byte-level tokens)");
    pre->add_option("--input,-i", inputs,
                    "Input files: .txt (documents separated by blank lines) "
                    "or .jsonl")
        ->required();
    pre->add_option("--output-prefix,-o", output, "Output prefix (writes PREFIX.bin, PREFIX.idx)")
        ->required();
    pre->add_option("--json-key", json_key, "JSONL field holding the text (default: text)");

    app.add_subcommand("keys", "List every recipe key with its default value");
    auto* info = app.add_subcommand("info", "Build and device information");

    auto* flops = app.add_subcommand("flops", "Audited model FLOPs per step of a recipe (SPEC 8)");
    std::string doc_lengths, convention = "audited";
    bool flops_json = false;
    flops->add_option("--recipe", recipe, "Recipe YAML")->required();
    flops->add_option("--set", sets, "Override a recipe key (key=value), repeatable");
    flops->add_option("--doc-lengths", doc_lengths,
                      "Comma-separated document lengths of one step (default: global_batch_size "
                      "documents of seq_length)");
    flops->add_option("--convention", convention,
                      "audited (default) or megatron (also print Megatron's stock formula)");
    flops->add_flag("--json", flops_json, "JSON: total_flops, terms, convention, tokens");

    auto* report = app.add_subcommand("report", "One self-contained HTML page from bench history");
    std::vector<std::string> histories;
    std::string report_out;
    report->add_option("--history", histories, "Bench history JSONL file, repeatable")->required();
    report->add_option("--out", report_out, "Output HTML file")->required();
    report->add_option("--recipe", recipe,
                       "Recipe whose FLOPs breakdown to draw when no record carries one");

    auto* bench = app.add_subcommand("bench", "Time training steps of a recipe on the GPU");
    BenchOptions bopt;
    std::string bench_json;
    bench->add_option("--recipe", recipe, "Recipe YAML")->required();
    bench->add_option("--set", sets, "Override a recipe key (key=value), repeatable");
    bench->add_option("--warmup", bopt.warmup, "Untimed iterations first (default 3)");
    bench->add_option("--iters", bopt.iters, "Timed iterations (default 10)");
    bench->add_flag("--forward-backward", bopt.forward_backward_only,
                    "Time forward+backward only (no optimizer step)");
    std::string bench_variants = "eager";
    bench->add_option("--variants", bench_variants,
                      "Comma-separated: eager, graph (interleaved A B B A; default eager)");
    bench->add_option("--commit", bopt.commit, "Commit recorded in the result");
    bench->add_option("--json", bench_json, "Append the result as one JSON line to this file");

    auto* bex = app.add_subcommand(
        "bench-exchange",
        "Under a launcher with GPUs: check the expert-parallel exchange and time it against a "
        "plain NCCL all-to-all of the same bytes");
    ExchangeBenchOptions xopt;
    std::string bex_json;
    bex->add_option("--rows", xopt.rows, "Routed rows per rank (default 32768: 4096 tokens x 8)");
    bex->add_option("--dim", xopt.dim, "bf16 values per row (default 6144)");
    bex->add_option("--experts", xopt.experts, "Experts, uniform routing (default 16)");
    bex->add_option("--warmup", xopt.warmup, "Untimed exchanges first (default 3)");
    bex->add_option("--iters", xopt.iters, "Timed exchanges (default 20)");
    bex->add_option("--json", bex_json, "Append the result as one JSON line to this file");

    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    }
    try {
        if (report->parsed()) {
            ReportInput in;
            in.history_files = histories;
            if (!recipe.empty()) {
                const Recipe r = load_recipe(recipe, sets);
                in.flops_terms = audited_flops(r.model, step_documents(r, "")).terms;
                in.flops_title = r.name;
            }
            const int n = write_report(in, report_out);
            std::printf("report: %d records -> %s\n", n, report_out.c_str());
            return 0;
        }
        if (flops->parsed()) return cmd_flops(recipe, sets, doc_lengths, convention, flops_json);
        if (bex->parsed()) {
            connect_gpus_if_launched(Device::CUDA);
            ST_CHECK(g_comm && g_comm->size() > 1,
                     "bench-exchange runs under a launcher with 2 or more processes (one GPU "
                     "each), e.g. scripts/launch-local.sh 2 sparsetron bench-exchange");
            const ExchangeBenchResult x = bench_expert_exchange(*g_comm, xopt);
            if (g_comm->rank() != 0) return 0;
            std::printf(
                "expert exchange | %s x %d | %lld rows x %lld bf16 per rank, %lld experts "
                "(uniform) | %.1f MB to peers per rank\n"
                "check: dispatch and combine delivered every row bit for bit (verified)\n"
                "%-28s %10s %12s\n%-28s %10.3f %12.1f\n%-28s %10.3f %12.1f\n"
                "exchange vs NCCL all-to-all: %.2fx the time\n",
                x.gpu.c_str(), x.ranks, static_cast<long long>(x.rows),
                static_cast<long long>(x.dim), static_cast<long long>(x.experts),
                x.peer_bytes / 1e6, "", "median ms", "GB/s to peers", "exchange dispatch",
                x.exchange_ms, x.exchange_gbps, "NCCL send/recv all-to-all", x.nccl_ms, x.nccl_gbps,
                x.exchange_ms / x.nccl_ms);
            if (!bex_json.empty()) {
                std::ofstream out(bex_json, std::ios::app);
                ST_CHECK(out.good(), "cannot write '", bex_json, "'");
                out << x.to_json() << "\n";
            }
            return 0;
        }
        if (bench->parsed()) {
            Recipe r = load_recipe(recipe, sets);
            bopt.variants = split_list(bench_variants);
            connect_gpus_if_launched(Device::CUDA);
            bopt.comm = g_comm;
            std::vector<BenchResult> res = run_bench(r, bopt);
            for (BenchResult& x : res) x.overrides = sets;
            if (g_comm && g_comm->rank() != 0) return 0;  // rank 0 reports
            std::printf(
                "%s | %s%s | %s | CUDA-event step times, %lld warm-up + %lld timed per "
                "variant\n%s\n",
                r.name.c_str(), res.front().gpu.c_str(),
                res.front().gpus > 1
                    ? cat(" x ", res.front().gpus, " (data parallel",
                          r.run.context_parallel_size > 1
                              ? cat(" x context parallel ", r.run.context_parallel_size)
                              : std::string(),
                          r.run.expert_model_parallel_size > 1
                              ? cat(", expert parallel ", r.run.expert_model_parallel_size)
                              : std::string(),
                          ", per GPU)")
                          .c_str()
                    : "",
                res.front().commit.c_str(), static_cast<long long>(bopt.warmup),
                static_cast<long long>(bopt.iters), bench_table(res).c_str());
            if (!bench_json.empty()) {
                std::ofstream out(bench_json, std::ios::app);
                ST_CHECK(out.good(), "cannot write '", bench_json, "'");
                for (const auto& x : res) out << x.to_json() << "\n";
            }
            return 0;
        }
        if (train->parsed()) return cmd_train(recipe, sets, out, resume, device, quiet, no_save);
        if (eval->parsed()) return cmd_eval(model, tokens, json);
        if (plan->parsed()) return cmd_plan(recipe, sets, plan_device);
        if (pre->parsed()) return cmd_preprocess(inputs, output, json_key);
        if (app.got_subcommand("keys")) return cmd_keys();
        if (info->parsed()) {
            std::printf("sparsetron %s\ncuda backend: %s\ngpu: %s\ncpu threads: %d\n",
                        SPARSETRON_VERSION,
#ifdef SPARSETRON_WITH_CUDA
                        "built",
#else
                        "not built",
#endif
                        cuda_available() ? cuda_device_name().c_str() : "none", num_threads());
            return 0;
        }
    } catch (const std::exception& e) {
        std::fflush(stdout);
        if (g_comm && g_comm->size() > 1) {
            // One failing rank takes the job down: no rank is left waiting in a collective.
            std::fprintf(stderr, "\nerror (rank %d of %d): %s\n", g_comm->rank(), g_comm->size(),
                         e.what());
            std::fflush(stderr);
            g_comm->abort(1);
        }
        std::fprintf(stderr, "\nerror: %s\n", e.what());
        return 1;
    }
    return 0;
}
