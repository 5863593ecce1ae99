// `sparsetron plan`: the memory plan of a recipe per memory class, on either backend.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "command.h"
#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/core/plan_growth.h"
#include "sparsetron/parallel/layout/layout.h"
#include "sparsetron/runtime/cuda_plan.h"
#include "sparsetron/runtime/host_memory_check.h"
#include "sparsetron/runtime/run_setup.h"
#include "sparsetron/runtime/training_plan.h"

namespace sparsetron::cli {
namespace {

// The step's packed micro-batches live in host memory outside the plan (both backends).
void print_step_batches(const Recipe& recipe, const TrainingPlan& tp) {
    const int64_t count = recipe.run.global_batch_size / recipe.run.micro_batch_size;
    std::printf("step: %lld micro-batches packed in host memory, %s (outside the plan)\n",
                static_cast<long long>(count),
                format_bytes(step_batch_host_bytes(count, recipe.run.tokens_per_microbatch(),
                                                   tp.max_documents))
                    .c_str());
}

// One process's plan of `stages` (its pipeline stages; the whole model by default);
// `optimizer_rank`: its place among the ranks holding the same parameters (its share of the
// distributed optimizer's masters and state).
void print_plan(const Recipe& recipe, const std::vector<PipelineStage>& stages,
                const std::string& device, int top, int optimizer_rank) {
    const Device d = parse_device(device);
    auto tp = make_training_plan(recipe, d, stages);
    const auto& params = *tp->params;
    if (d == Device::CUDA) {
        size_t total = 0;
        const std::string table = format_cuda_plan(
            recipe, params, tp->max_documents, tp->chunk_rows, &total, top, stages, optimizer_rank);
        std::printf("device memory plan for %s (per GPU; bf16 activations and weight copies, %s)\n",
                    recipe.name.c_str(),
                    recipe.run.grad_reduce_in_bf16
                        ? "fp32 masters and optimizer state, bf16 gradients of the GEMMs' "
                          "weights (grad_reduce_in_bf16)"
                        : "fp32 masters, gradients and optimizer state");
        std::printf(
            "micro-batch: %lld token slots, at most %lld documents; loss chunk %lld "
            "rows\n\n%s",
            static_cast<long long>(recipe.run.tokens_per_microbatch()),
            static_cast<long long>(tp->max_documents), static_cast<long long>(tp->chunk_rows),
            table.c_str());
        print_step_batches(recipe, *tp);
        std::printf("plus the CUDA context and cuBLASLt's 64 MiB workspace (not planned)\n");
        print_newton_schulz(newton_schulz_count(params, recipe.model, recipe.run), recipe.run);
        return;
    }
    std::printf("memory plan for %s (per process; fp32 CPU training)\n", recipe.name.c_str());
    std::printf("parameters: %lld tensors, %.3fM elements\n",
                static_cast<long long>(params.params().size()), params.total_numel() / 1e6);
    std::printf("micro-batch: %lld token slots, at most %lld documents; loss chunk %lld rows\n",
                static_cast<long long>(recipe.run.tokens_per_microbatch()),
                static_cast<long long>(tp->max_documents), static_cast<long long>(tp->chunk_rows));
    print_step_batches(recipe, *tp);
    if (tp->rows.key_rows > 0)
        std::printf(
            "context parallelism: this rank computes %lld rows of micro-batches of %lld "
            "key rows\n",
            static_cast<long long>(tp->rows.rows), static_cast<long long>(tp->rows.key_rows));
    std::printf("\n");
    std::printf("%s", tp->plan.format(top).c_str());
    std::printf("largest kinds of buffer (alike but for layer or expert numbers, summed):\n%s\n",
                tp->plan.format_kinds(top).c_str());
    std::printf("%s", tp->optimizer->describe(tp->plan).c_str());
    print_newton_schulz(newton_schulz_count(params, recipe.model, recipe.run), recipe.run);
}

int plan(const std::string& recipe_path, const std::vector<std::string>& sets,
         const std::string& device, int top, int world_rank) {
    const Recipe recipe = resolve_run(RunRequest::of(RunRequest::Plan, recipe_path, sets)).recipe;
    const int world = int(recipe.run.world_size);
    ST_CHECK(world_rank < world, "--world-rank ", world_rank, ": the recipe's world_size is ",
             world, " (ranks 0-", world - 1, ")");
    const ParallelLayout layout = make_layout(recipe.run, world);
    // The CUDA engine's distributed optimizer shards memory (the CPU backend's shards the work).
    const bool sharded = recipe.run.use_distributed_optimizer && layout.stage_size() > 1 &&
                         parse_device(device) == Device::CUDA;
    if (world > 1)
        std::printf(
            "parallel layout: %s\nnote: each plan below is %s (every EP rank holds as many "
            "experts; expert parallelism adds its worst-case receive rows)%s\n",
            layout.describe().c_str(),
            world_rank >= 0 ? cat("rank ", world_rank, "'s").c_str()
                            : "of its stage's first rank; --world-rank N shows rank N's",
            sharded ? cat("; the distributed optimizer keeps a rank's share of the fp32 masters "
                          "and optimizer state, over the ",
                          layout.stage_size(), " ranks holding the same parameters")
                          .c_str()
                    : "");
    const int stages = int(recipe.run.pipeline_model_parallel_size);
    if (stages == 1 || world_rank >= 0) {
        const std::vector<PipelineStage> held =
            stages == 1
                ? std::vector<PipelineStage>{PipelineStage{}}
                : pipeline_rank_stages(recipe.model, recipe.run, layout.pp_rank(world_rank));
        print_plan(recipe, held, device, top, world_rank >= 0 ? layout.stage_rank(world_rank) : 0);
        return 0;
    }
    // Pipeline parallelism: each pipeline rank holds its stages' layers (and the embedding, or
    // the head, the losses and the MTP layer): one plan per pipeline rank.
    for (int r = 0; r < stages; ++r) {
        const std::vector<PipelineStage> held = pipeline_rank_stages(recipe.model, recipe.run, r);
        std::string what;
        for (const PipelineStage& stage : held) {
            const int64_t end = stage.end_layer < 0 ? recipe.model.num_layers : stage.end_layer;
            what += cat(what.empty() ? "" : "; ",
                        held.size() > 1 ? cat("stage ", stage.index, ": ") : "", "decoder layers ",
                        stage.first_layer, "-", end - 1, stage.first() ? ", the embedding" : "",
                        stage.last() ? ", the final norm, head, losses and MTP" : "");
        }
        std::printf("\n== pipeline stage %d of %d: %s ==\n", r, stages, what.c_str());
        print_plan(recipe, held, device, top, 0);
    }
    return 0;
}

// Every rank's total (device plan with the expert exchange's buffers, or the host plan), ranks
// of one stage with equal printed totals in one line, and the largest: what a layout needs of
// its smallest GPU.
int plan_every_rank(const std::string& recipe_path, const std::vector<std::string>& sets,
                    const std::string& device) {
    const Recipe recipe = resolve_run(RunRequest::of(RunRequest::Plan, recipe_path, sets)).recipe;
    const Device d = parse_device(device);
    const int world = int(recipe.run.world_size);
    const ParallelLayout layout = make_layout(recipe.run, world);
    const int stages = int(recipe.run.pipeline_model_parallel_size);
    std::vector<std::unique_ptr<TrainingPlan>> by_stage(static_cast<size_t>(stages));
    std::printf("%s plan of every rank of %s (%s)\n", d == Device::CUDA ? "device" : "host",
                recipe.name.c_str(), layout.describe().c_str());
    size_t largest = 0;
    int largest_rank = 0, run_start = 0;
    size_t run_total = 0;
    auto flush = [&](int end) {  // ranks [run_start, end) planned run_total each
        const int s = stages == 1 ? 0 : layout.pp_rank(run_start);
        std::printf("  %s %d%s%s: %s\n", end - run_start > 1 ? "ranks" : "rank", run_start,
                    end - run_start > 1 ? cat("-", end - 1).c_str() : "",
                    stages > 1 ? cat(" (stage ", s, ")").c_str() : "",
                    format_bytes(double(run_total)).c_str());
    };
    for (int r = 0; r < world; ++r) {
        const int s = stages == 1 ? 0 : layout.pp_rank(r);
        // The pipeline rank's stages: one, or its chunks under interleaving.
        const std::vector<PipelineStage> held =
            stages == 1 ? std::vector<PipelineStage>{PipelineStage{}}
                        : pipeline_rank_stages(recipe.model, recipe.run, s);
        if (!by_stage[size_t(s)]) by_stage[size_t(s)] = make_training_plan(recipe, d, held);
        const TrainingPlan& tp = *by_stage[size_t(s)];
        size_t total = tp.plan.total_bytes();
        if (d == Device::CUDA)
            format_cuda_plan(recipe, *tp.params, tp.max_documents, tp.chunk_rows, &total, 0, held,
                             layout.stage_rank(r));
        // Equal as printed: the distributed optimizer's shares differ by a few MiB.
        if (r > 0 && (format_bytes(double(total)) != format_bytes(double(run_total)) ||
                      layout.pp_rank(r) != layout.pp_rank(run_start))) {
            flush(r);
            run_start = r;
        }
        run_total = total;
        if (total > largest) largest = total, largest_rank = r;
    }
    flush(world);
    std::printf("largest: rank %d, %s\n", largest_rank, format_bytes(double(largest)).c_str());
    return 0;
}

// The plans at several micro-batch lengths (seq_length per sample) and how each buffer grows.
int plan_lengths(const std::string& recipe_path, const std::vector<std::string>& sets,
                 const std::string& device, const std::string& lengths_text, int top) {
    std::vector<int64_t> lengths;
    for (const std::string& item : split_list(lengths_text)) {
        char* end = nullptr;
        const long long v = std::strtoll(item.c_str(), &end, 10);
        ST_CHECK(end && *end == '\0' && v > 0, "--lengths: '", item,
                 "' is not a positive token count");
        lengths.push_back(v);
    }
    const bool cuda = parse_device(device) == Device::CUDA;
    std::string pp_note;  // the growth of the whole model's buffers; stages hold parts of them
    std::vector<std::unique_ptr<TrainingPlan>> training;
    std::vector<MemoryPlan> device_plans;
    std::vector<const MemoryPlan*> plans;
    std::vector<int64_t> tokens;
    std::string name;
    int64_t vocab = 0;
    for (int64_t length : lengths) {
        std::vector<std::string> at = sets;
        at.push_back(cat("seq_length=", length));
        const Recipe recipe = resolve_run(RunRequest::of(RunRequest::Plan, recipe_path, at)).recipe;
        name = recipe.name;
        vocab = recipe.model.vocab_size;
        if (recipe.run.pipeline_model_parallel_size > 1)
            pp_note = "; the whole model's: `plan` without --lengths shows each pipeline stage";
        training.push_back(make_training_plan(recipe, cuda ? Device::CUDA : Device::CPU));
        tokens.push_back(recipe.run.tokens_per_microbatch());
        const TrainingPlan& tp = *training.back();
        if (cuda)
            device_plans.push_back(
                cuda_memory_plan(recipe, *tp.params, tp.max_documents, tp.chunk_rows));
    }
    for (size_t i = 0; i < lengths.size(); ++i)
        plans.push_back(cuda ? &device_plans[i] : &training[i]->plan);
    std::printf("%s memory plan of %s at each micro-batch length (seq_length per sample%s)\n\n%s",
                cuda ? "device" : "host", name.c_str(), pp_note.c_str(),
                plan_growth(tokens, plans, vocab).format(top).c_str());
    return 0;
}

}  // namespace

Run add_plan(CLI::App& app) {
    struct Options {
        std::string recipe, device = "cpu", lengths;
        int top = -1, world_rank = -1;
        bool every_rank = false;
        std::vector<std::string> sets;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("plan", "Print the memory plan of a recipe per memory class");
    c->add_option("--recipe,-r", o->recipe,
                  "Recipe YAML, or a recipe and its overlays: base.yaml,overlay.yaml (default: "
                  "built-in tiny)");
    c->add_option("--set,-s", o->sets, "Override a recipe key: --set key=value (repeatable)");
    c->add_option("--device", o->device, "cpu (default) or cuda: the plan of that backend");
    c->add_option("--lengths", o->lengths,
                  "Comma-separated seq_length values, ascending: the plan's class totals at each "
                  "and the buffers that grow faster than the tokens");
    c->add_option("--world-rank", o->world_rank,
                  "The plan of this rank of the recipe's world_size (its pipeline stage and its "
                  "share of the distributed optimizer; default: each stage's first rank)")
        ->check(CLI::NonNegativeNumber);
    c->add_flag("--every-rank", o->every_rank,
                "One line per rank of the recipe's world_size (ranks with equal plans together): "
                "its total, and the largest");
    c->add_option("--top", o->top,
                  "How many buffers each list shows (default 6 per class; 12 with --lengths)");
    return [o] {
        if (o->every_rank) return plan_every_rank(o->recipe, o->sets, o->device);
        return o->lengths.empty()
                   ? plan(o->recipe, o->sets, o->device, o->top < 0 ? 6 : o->top, o->world_rank)
                   : plan_lengths(o->recipe, o->sets, o->device, o->lengths,
                                  o->top < 0 ? 12 : o->top);
    };
}

}  // namespace sparsetron::cli
