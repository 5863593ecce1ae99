// resolve_run (run_setup.h): reads recipe files and checkpoint recipes (YAML), so it is built
// into the static recipe library with the YAML reader, not into the engine library.
#include <filesystem>
#include <set>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/error.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/runtime/run_setup.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

// A recipe from a checkpoint's recipe.yaml. The save writes every key, so a file missing some
// was cut or edited: it is refused rather than read as the built-in defaults for what it lacks.
Recipe checkpoint_recipe(const std::string& ckpt) {
    const std::string origin = ckpt + "/recipe.yaml";
    Recipe r;
    std::set<std::string> set;
    for (const auto& s : parse_recipe_yaml(load_checkpoint_recipe(ckpt), origin)) {
        r.apply(s);
        set.insert(s.key);
    }
    std::string missing;
    int64_t count = 0;
    for (const std::string& key : recipe_key_names())
        if (!set.count(key) && ++count <= 5) missing += (missing.empty() ? "" : ", ") + key;
    ST_CHECK(count == 0, origin, " lacks ", count, " of the recipe's keys (", missing,
             count > 5 ? ", ..." : "",
             "): a checkpoint's recipe holds every key, so the file was cut or edited; give the "
             "run's recipe with --recipe");
    return r;
}

// Where a run writes when --out is not given: a resumed run continues in the directory it
// resumed from (the parent of its `checkpoints/`, or the save directory itself), a fresh one in
// runs/<recipe name>.
std::string default_out(const std::string& recipe_path, const std::string& resume, Recipe& recipe) {
    if (!resume.empty()) {
        const fs::path save_dir = fs::path(resolve_checkpoint(resume)).parent_path();
        if (save_dir.filename() == "checkpoints") return save_dir.parent_path().string();
        // Checkpoints outside <out>/checkpoints: keep saving next to the resumed one.
        if (recipe.run.save.empty()) recipe.run.save = save_dir.string();
        return save_dir.string();
    }
    const std::string first = recipe_path.substr(0, recipe_path.find(','));
    return (fs::path("runs") / (first.empty() ? "tiny" : fs::path(first).stem())).string();
}

ResolvedRun resolve_training_run(const RunRequest& q) {
    ST_CHECK(q.resume.empty() || !is_model_dir(q.resume) ||
                 fs::exists(fs::path(q.resume) / "trainer_state.json"),
             "--resume continues a training run, and '", q.resume,
             "' holds a model without training state: start from its weights with --load");
    std::vector<std::string> sets = q.sets;
    if (!q.load.empty()) sets.push_back("load=" + q.load);
    ResolvedRun out;
    Recipe& recipe = out.recipe;
    if (q.recipe.empty() && !q.resume.empty()) {
        // Resuming without --recipe: continue with the recipe stored in the checkpoint.
        const std::string ckpt = resolve_checkpoint(q.resume);
        recipe = checkpoint_recipe(ckpt);
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
        recipe = load_recipe(q.recipe, sets);
        // Pretrained weights without a recipe: the model is the one config.json describes.
        const std::string weights = pretrained_weights_dir(recipe.run, "");
        if (q.recipe.empty() && !weights.empty() && fs::exists(fs::path(weights) / "config.json")) {
            recipe.model = load_hf_config((fs::path(weights) / "config.json").string());
            for (const auto& o : sets) recipe.apply(parse_override(o));
            recipe.validate();
            recipe.name = weights + "/config.json";
        }
    }
    out.out_dir = q.out.empty() ? default_out(q.recipe, q.resume, recipe) : q.out;
    return out;
}

// The recipe the model trained with, when it is an engine checkpoint (its recipe.yaml), as one
// process: the run's layout does not apply to evaluation.
ResolvedRun resolve_eval_run(const RunRequest& q) {
    ResolvedRun out;
    const std::string& model = q.model;
    out.has_recipe = false;
    if (is_model_dir(model) && !fs::exists(fs::path(model) / "recipe.yaml")) return out;
    const std::string ckpt = is_model_dir(model) ? model : resolve_checkpoint(model);
    if (!fs::exists(fs::path(ckpt) / "recipe.yaml")) return out;
    Recipe& r = out.recipe;
    r = checkpoint_recipe(ckpt);
    r.run.world_size = r.run.expert_model_parallel_size = r.run.context_parallel_size = 1;
    r.run.pipeline_model_parallel_size = 1;
    r.run.dynamic_context_parallel = false;
    r.run.global_batch_size = r.run.micro_batch_size;
    r.validate();  // derives the layer patterns the model reads
    r.name = ckpt + "/recipe.yaml";
    out.has_recipe = true;
    return out;
}

}  // namespace

ResolvedRun resolve_run(const RunRequest& q) {
    switch (q.kind) {
        case RunRequest::Train:
            return resolve_training_run(q);
        case RunRequest::Eval:
            return resolve_eval_run(q);
        case RunRequest::Plan:
        case RunRequest::Bench:
            break;
    }
    ResolvedRun out;
    out.recipe = load_recipe(q.recipe, q.sets);
    return out;
}

}  // namespace sparsetron
