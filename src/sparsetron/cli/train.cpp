// `sparsetron train`: a training run with progress on screen, metrics.jsonl and checkpoints.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
#include "progress.h"
#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/stop_request.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/metrics_log.h"
#include "sparsetron/io/tensorboard.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/perf/timed_window.h"
#include "sparsetron/runtime/run_setup.h"
#include "sparsetron/runtime/step_log.h"
#include "sparsetron/runtime/trainer.h"

namespace fs = std::filesystem;

namespace sparsetron::cli {
namespace {

// Under OpenMPI's mpirun a SIGTERM or SIGINT to mpirun reaches the ranks as SIGTERM after
// odls_base_sigkill_timeout seconds (default 1), followed by SIGKILL as long again: a step and
// a save that take longer are lost. Said once, after the first step, when that is the case.
void note_mpirun_kill_timing(double step_ms, const std::string& out) {
    if (!env_value("OMPI_COMM_WORLD_SIZE")) return;
    const auto set = env_value("OMPI_MCA_odls_base_sigkill_timeout");
    const double grace_s = set ? std::atof(set->c_str()) : 1.0;
    const double step_s = step_ms / 1000.0;
    if (step_s < 0.5 * grace_s) return;
    std::fprintf(stderr,
                 "note: a signal to mpirun reaches these ranks %.0f s before its SIGKILL, and a "
                 "step takes %.1f s: stop this run with `sparsetron stop %s` (the ranks save and "
                 "exit), or launch with `mpirun --mca odls_base_sigkill_timeout %.0f`\n",
                 grace_s, step_s, out.c_str(), std::ceil(4 * step_s + 30));
}

int train(const std::string& recipe_path, const std::vector<std::string>& sets,
          const std::string& out_arg, const std::string& resume, const std::string& device,
          const std::string& load, bool quiet, bool no_save, const std::string& timed_window) {
    TimedWindow window = timed_window.empty() ? TimedWindow{} : TimedWindow::parse(timed_window);
    RunRequest request;
    request.recipe = recipe_path, request.sets = sets, request.resume = resume;
    request.load = load, request.out = out_arg;
    const ResolvedRun run = resolve_run(request);
    const Recipe& recipe = run.recipe;
    const std::string& out = run.out_dir;
    connect_gpus_if_launched(parse_device(device));
    TrainOptions opts{out, resume, parse_device(device), !no_save, launch_comm()};
    Trainer trainer(recipe, opts);
    if (trainer.recipe().run.exit_signal_handler) install_stop_request_handlers();
    // Rank 0 reports and writes the metrics; the other ranks train silently.
    if (trainer.world_rank() != 0) {
        const Trainer::End end = trainer.run();
        return end.kind == Trainer::End::Signal ? 128 + end.signal : 0;
    }
    const auto& r = trainer.recipe().run;
    const auto& params = trainer.params();
    const std::string dp =
        trainer.world_size() > 1 && launch_comm()
            ? cat(" | ", trainer.world_size(), " ", launch_comm()->name(), " ranks: ",
                  r.pipeline_model_parallel_size > 1
                      ? cat("pipeline ", r.pipeline_model_parallel_size, " stages x ")
                      : std::string(),
                  "data parallel ", trainer.data_parallel_size(),
                  r.context_parallel_size > 1 ? cat(" x context parallel ", r.context_parallel_size)
                                              : std::string(),
                  r.expert_model_parallel_size > 1
                      ? cat(", expert parallel ", r.expert_model_parallel_size)
                      : std::string())
            : std::string();
    std::printf("sparsetron %s | recipe %s | device %s%s\n", SPARSETRON_VERSION,
                recipe.name.c_str(), trainer.device_description().c_str(), dp.c_str());
    // Under pipeline parallelism this rank (rank 0) holds its stages (its EP rank's experts too).
    std::string held;
    for (const PipelineStage& stage : trainer.stages())
        if (!stage.whole())
            held += cat(held.empty() ? " on stage " : ", stage ", stage.index + 1, " of ",
                        stage.count, " (layers ", stage.first_layer, "-", stage.end_layer - 1, ")");
    std::printf("model: %lld layers, hidden %lld, %lld heads, vocab %lld | %.2fM parameters%s\n",
                static_cast<long long>(recipe.model.num_layers),
                static_cast<long long>(recipe.model.hidden_size),
                static_cast<long long>(recipe.model.num_attention_heads),
                static_cast<long long>(recipe.model.vocab_size), params.total_numel() / 1e6,
                held.c_str());
    std::printf("batch: %lld micro-batches%s x %lld token slots | %s %s | output %s\n",
                static_cast<long long>(r.microbatches_per_step()),
                trainer.data_parallel_size() > 1
                    ? cat(" per data-parallel rank x ", trainer.data_parallel_size()).c_str()
                    : "",
                static_cast<long long>(r.tokens_per_microbatch()),
                opts.device == Device::CUDA ? "host mirror (planned, all classes)" : "memory plan",
                format_bytes(double(trainer.plan().total_bytes())).c_str(), out.c_str());
    print_newton_schulz(newton_schulz_count(params, trainer.recipe().model, r), r);
    const auto modules_line = [&](const char* what, const std::vector<std::string>& modules) {
        std::string mods;
        for (const std::string& m : modules) mods += (mods.empty() ? "" : ", ") + m;
        std::printf("%s: %s%s\n", what, mods.c_str(),
                    opts.device == Device::CUDA ? ""
                                                : " (applies on --device cuda; the CPU backend "
                                                  "keeps every activation)");
    };
    if (recipe.model.recompute_granularity == "selective")
        modules_line("selective recompute", recipe.model.recompute_modules);
    if (recipe.model.fine_grained_activation_offloading)
        modules_line("activation offload to pinned host memory", recipe.model.offload_modules);
    if (trainer.iteration() > 0)
        std::printf("resumed at iteration %lld\n", static_cast<long long>(trainer.iteration()));
    if (!trainer.pretrained_from().empty()) {
        std::printf("weights from %s (iteration 0, fresh optimizer state)\n",
                    trainer.pretrained_from().c_str());
        const auto& init = trainer.initialized_parameters();
        if (!init.empty())
            std::printf(
                "%zu parameters are not in it and start from their initialization: the "
                "MTP layers (%s, ...)\n",
                init.size(), init.front().c_str());
    }
    std::fflush(stdout);

    fs::path metrics_path = fs::path(out) / "metrics.jsonl";
    if (trainer.iteration() > 0)
        trim_metrics_log(metrics_path.string(), trainer.iteration());
    else
        fs::remove(metrics_path);
    std::ofstream metrics(metrics_path, std::ios::app);
    ST_CHECK(metrics.good(), "cannot write '", metrics_path.string(), "'");
    // TensorBoard on the first rank only (the metrics are every rank's sums).
    std::unique_ptr<TensorBoardWriter> tb;
    if (!r.tensorboard_dir.empty() && trainer.world_rank() == 0)
        tb = std::make_unique<TensorBoardWriter>(r.tensorboard_dir);
    bool tb_failed = false;
    cli::Progress progress(trainer.iteration(), r.train_iters, r.log_interval, quiet);
    double first_loss = -1, last_loss = -1;
    StepMetrics first_metrics, last_metrics;
    int64_t first_step = 0;
    const Trainer::End end = trainer.run([&](const StepMetrics& m) {
        metrics << m.to_json() << "\n";
        metrics.flush();
        ST_CHECK(metrics.good(), "writing '", metrics_path.string(), "' failed at step ", m.step,
                 " (disk full?); the run stops (resume from its last checkpoint)");
        if (first_loss < 0) {
            first_loss = m.lm_loss, first_step = m.step, first_metrics = m;
            if (r.exit_signal_handler) note_mpirun_kill_timing(m.step_ms, out);
        }
        last_loss = m.lm_loss;
        last_metrics = m;
        if (window.active() && !window.complete())
            window.add(m.step_ms, audited_flops(trainer.recipe().model, m.doc_lengths).total);
        progress.update(m);
        progress.validation(m);
        if (tb && !tb_failed) {
            write_step_scalars(*tb, m, trainer.memory_gib());
            if (!tb->flush()) {
                tb_failed = true;  // the run goes on: metrics.jsonl holds the same figures
                std::fprintf(stderr,
                             "warning: writing '%s' failed at step %lld; TensorBoard "
                             "logging stops\n",
                             tb->path().c_str(), static_cast<long long>(m.step));
            }
        }
    });
    progress.finish();
    // How the run ended and where it saved: on stderr too when stdout is gone (a closed pipe or
    // terminal), so the one who stopped it still reads it.
    std::fflush(stdout);
    const bool stdout_gone = std::ferror(stdout) != 0;
    const auto say = [&](const std::string& line) {
        std::fputs(line.c_str(), stdout);
        if (stdout_gone) std::fputs(line.c_str(), stderr);
    };
    if (end.kind != Trainer::End::Finished)
        say(cat("stopped after step ", trainer.iteration(), " (",
                end.kind == Trainer::End::Signal         ? stop_signal_name(end.signal)
                : end.kind == Trainer::End::ExitInterval ? "exit_interval"
                                                         : "exit_duration_in_mins",
                ")", no_save ? "" : "; resume with --resume", "\n"));
    if (first_loss >= 0) {
        std::printf("lm_loss %.4f -> %.4f over steps %lld..%lld\n", first_loss, last_loss,
                    static_cast<long long>(first_step),
                    static_cast<long long>(trainer.iteration()));
        if (last_metrics.mtp_loss > 0)
            std::printf("mtp_loss %.4f -> %.4f, indexer_loss %.3e -> %.3e\n",
                        first_metrics.mtp_loss, last_metrics.mtp_loss, first_metrics.indexer_loss,
                        last_metrics.indexer_loss);
    }
    if (window.active()) {
        // The seed's formal figures: also as JSON beside the metrics.
        const int gpus = trainer.world_size();
        std::printf("%s\n", window.summary(gpus).c_str());
        std::ofstream(fs::path(out) / "timed_window.json") << window.to_json(gpus) << "\n";
    }
    if (!no_save) say(cat("checkpoint: ", resolve_checkpoint(trainer.checkpoint_dir()), "\n"));
    std::printf("metrics: %s\n", metrics_path.c_str());
    return end.kind == Trainer::End::Signal ? 128 + end.signal : 0;
}

}  // namespace

Run add_train(CLI::App& app) {
    struct Options {
        std::string recipe, out, resume, device, load, timed_window;
        std::vector<std::string> sets;
        bool quiet = false, no_save = false;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("train",
                                 "Train a model (default: the tiny recipe on the bundled corpus, "
                                 "on CPU)");
    c->add_option("--recipe,-r", o->recipe,
                  "Recipe YAML (Megatron keys), or a recipe and its overlays: "
                  "base.yaml,overlay.yaml; default: built-in tiny");
    c->add_option("--set,-s", o->sets, "Override a recipe key: --set key=value (repeatable)");
    c->add_option("--out,-o", o->out,
                  "Output directory for metrics.jsonl and checkpoints (default: runs/<recipe "
                  "name>)");
    c->add_option("--resume", o->resume,
                  "Resume from a checkpoint or a save directory (its latest checkpoint); uses "
                  "its recipe unless --recipe");
    c->add_option("--load", o->load,
                  "Megatron's load: an HF directory (config.json + safetensors, fp32/bf16/FP8) "
                  "starts a fresh run from its weights, model dimensions from its config.json "
                  "unless --recipe; an engine checkpoint resumes (with --set finetune=true: "
                  "weights only)");
    c->add_option("--device", o->device, "cpu or cuda (default: cpu)");
    c->add_flag("--quiet,-q", o->quiet, "No progress output");
    c->add_flag("--no-save", o->no_save, "Write no checkpoint (metrics only)");
    c->add_option("--timed-window", o->timed_window,
                  "WARMUP,MEASURED: after WARMUP steps, the next MEASURED steps' median and p95 "
                  "step time, CV and audited TFLOPS/GPU, printed at the end and written to "
                  "timed_window.json (the seed's: 8,20)");
    return [o] {
        return train(o->recipe, o->sets, o->out, o->resume, o->device, o->load, o->quiet,
                     o->no_save, o->timed_window);
    };
}

}  // namespace sparsetron::cli
