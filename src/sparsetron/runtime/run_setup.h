// A run's setup, below the command line: which recipe it runs (a recipe file and its overlays,
// a checkpoint's recipe on resume, an HF config.json for pretrained weights, the overrides,
// validation), where it writes, the data it reads and the weights it starts from. `train`,
// `eval`, `plan` and `bench` resolve their runs here; the CLI only parses arguments and prints.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/recipe.h"

namespace sparsetron {

// What a command line names of a run.
struct RunRequest {
    enum Kind { Train, Eval, Plan, Bench } kind = Train;
    std::string recipe;             // a recipe and its overlays ("base.yaml,overlay.yaml")
    std::vector<std::string> sets;  // overrides, "key=value"
    std::string resume;             // train: a checkpoint or save directory to continue
    std::string load;               // train: Megatron's `load` (an HF directory or a checkpoint)
    std::string out;                // train: the output directory ("" = the default)
    std::string model;              // eval: a checkpoint, save directory or HF directory

    // A request that names only a recipe and its overrides (plan, bench).
    static RunRequest of(Kind kind, std::string recipe, std::vector<std::string> sets) {
        RunRequest r;
        r.kind = kind, r.recipe = std::move(recipe), r.sets = std::move(sets);
        return r;
    }
};

struct ResolvedRun {
    Recipe recipe;
    // Eval: whether the model came with the recipe it trained with (its recipe.yaml); without
    // one (an HF directory) only the LM loss is known.
    bool has_recipe = true;
    std::string out_dir;  // train: where metrics and checkpoints go
};

// Train: without --recipe a resume continues with the checkpoint's recipe, and pretrained
// weights with a config.json take their model from it; the overrides apply last; the output
// directory defaults to the resumed run's (or runs/<recipe name>). Eval: the model's recipe as
// one process (its layout dropped). Plan and bench: the recipe file and its overlays. Throws,
// naming the file and key, for what does not validate.
ResolvedRun resolve_run(const RunRequest& request);

// Where a run's weights come from when it does not resume: an HF directory or an engine
// checkpoint given by pretrained_checkpoint, by `load` with finetune, or by a `load` that is an
// HF directory; "" for a fresh initialization or a full resume.
std::string pretrained_weights_dir(const RunConfig& run, const std::string& resume_dir);
// Stops, naming the field and both values, when `dir`/config.json describes another model than
// `model` (the dimensions that shape the weights).
void check_pretrained_config(const std::string& dir, const ModelConfig& model);
// Stops, naming the tensors, when the checkpoint in `ckpt_dir` holds trained weights that the
// whole model of `model` has no parameter for (MTP layers with a smaller mtp_num_layers, the
// indexer with DSA off): a resume would drop them without a word.
void check_checkpoint_weights_kept(const std::string& ckpt_dir, const ModelConfig& model);

// Resolves an empty data_path to the bundled corpus, preprocessed into `out_dir`/data once.
std::vector<std::string> resolve_data_path(const RunConfig& run, const std::string& out_dir);

}  // namespace sparsetron
