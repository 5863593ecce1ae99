// What a checkpoint's readers refuse (the reliability probe's second pass): files of another
// iteration mixed in, a corrupt or non-finite checkpoint given to `convert`, a cut recipe.yaml,
// a trainer state outside its data, a resume that would drop trained weights, a save directory
// two runs share; and the logs and data a run keeps safe (metrics.jsonl never rewritten in place,
// a dataset cut during the run named rather than a SIGBUS).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/data/indexed_dataset.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/checkpoint_identity.h"
#include "sparsetron/io/metrics_log.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

Recipe identity_recipe(std::vector<std::string> extra = {}) {
    std::vector<std::string> sets = test::small_model_sets();
    sets.insert(sets.end(), {"global_batch_size=2", "train_iters=4", "lr_warmup_iters=1",
                             "save_interval=2", "save_keep_last=5"});
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_recipe("", sets);
}

// A run of 4 steps saving at 2 and 4; returns its save directory.
std::string saved_run_dir(const std::string& out) {
    Trainer t(identity_recipe(), {out, "", Device::CPU});
    t.run();
    return t.checkpoint_dir();
}

void put_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string identity_resume_error(const std::string& ckpt, std::vector<std::string> extra = {}) {
    return test::error_of([&] {
        Trainer t(identity_recipe(extra), {test::temp_dir("resumed"), ckpt, Device::CPU});
    });
}

}  // namespace

// Files copied in from another iteration are refused by every reader, naming the file and where
// it came from (they were loaded: iteration 4's state with iteration 2's weights).
TEST(CheckpointIdentity, FilesOfAnotherIterationAreRefused) {
    const std::string save = saved_run_dir(test::temp_dir("mixed"));
    const std::string it2 = save + "/iter_0000002", it4 = save + "/iter_0000004";
    EXPECT_EQ(identity_resume_error(it4), "");
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
        const std::string original = test::read_text(it4 + "/" + file);
        fs::copy_file(it2 + "/" + file, it4 + "/" + file, fs::copy_options::overwrite_existing);
        const std::string msg = identity_resume_error(it4);
        EXPECT_NE(msg.find(it4 + "/" + file + " does not belong to this checkpoint (iteration 4"),
                  std::string::npos)
            << file << ": " << msg;
        EXPECT_NE(msg.find("the file says it is iteration 2 of run"), std::string::npos) << msg;
        if (std::string(file) == "model.safetensors") {
            std::ofstream(save + "/tokens.txt") << "5 17 99 3 250 41 7\n";
            const test::CliRun ev =
                test::run_cli("eval --model " + it4 + " --tokens " + save + "/tokens.txt --json");
            EXPECT_EQ(ev.code, 1) << ev.output;
            EXPECT_NE(ev.output.find("does not belong to this checkpoint"), std::string::npos)
                << ev.output;
            const test::CliRun cv =
                test::run_cli("convert --input " + it4 + " --output " + test::temp_dir("mixed-hf"));
            EXPECT_EQ(cv.code, 1) << cv.output;
            EXPECT_NE(cv.output.find("does not belong to this checkpoint"), std::string::npos)
                << cv.output;
        }
        put_bytes(it4 + "/" + file, original);
    }
    EXPECT_EQ(identity_resume_error(it4), "");
    // A file changed after the save (the recipe: iterations 2 and 4 share its bytes).
    const std::string recipe = test::read_text(it4 + "/recipe.yaml");
    put_bytes(it4 + "/recipe.yaml", recipe + "# edited\n");
    EXPECT_NE(identity_resume_error(it4).find("recipe.yaml does not belong to this checkpoint"),
              std::string::npos);
    put_bytes(it4 + "/recipe.yaml", recipe);
    // A recorded file that is gone.
    fs::remove(it4 + "/config.json");
    EXPECT_NE(identity_resume_error(it4).find("config.json is missing"), std::string::npos);
}

// convert verifies what train verifies: a flipped bit (CRC-32C) and a non-finite weight are
// refused, not exported with fresh checksums.
TEST(CheckpointIdentity, ConvertRefusesWhatTrainRefuses) {
    const std::string save = saved_run_dir(test::temp_dir("convert-corrupt"));
    const std::string ckpt = save + "/iter_0000004", file = ckpt + "/model.safetensors";
    const std::string original = test::read_text(file);
    std::string bytes = original;
    bytes[bytes.size() - 5] ^= 0x10;  // inside the last tensor's data; the header is intact
    put_bytes(file, bytes);
    test::CliRun r =
        test::run_cli("convert --input " + ckpt + " --output " + test::temp_dir("hf-corrupt"));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("is corrupt: its CRC-32C is"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(test::temp_dir("hf-corrupt") + "/model.safetensors"));
    put_bytes(file, original);

    // A NaN weight saved by the engine (valid CRCs, valid digests).
    Recipe rc = identity_recipe();
    auto tp = make_training_plan(rc, Device::CPU);
    tp->plan.allocate(Device::CPU);
    tp->cpu_models.front()->bind();
    tp->params->initialize(tp->plan, 1, rc.model.init_method_std, rc.model.num_layers);
    const ParamInfo& p = tp->params->params().back();
    tp->plan.view(p.param_slot).ptr<float>()[2] = std::nanf("");
    TrainerState st;
    st.iteration = 1;
    st.data_position = "{}";
    st.run_id = new_run_id();
    const std::string nan_ckpt = save_checkpoint(test::temp_dir("nan"), {}, rc.model, rc.to_yaml(),
                                                 *tp->params, tp->plan, tp->optimizer.get(), st);
    r = test::run_cli("convert --input " + nan_ckpt + " --output " + test::temp_dir("hf-nan"));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("tensor '" + p.name + "' holds nan at element 2"), std::string::npos)
        << r.output;
}

// Two runs with different --out but one `save` directory: the second stops naming the first
// (both trained and the second deleted the first one's checkpoints).
TEST(CheckpointIdentity, TwoRunsCannotShareASaveDirectory) {
    const std::string save = test::temp_dir("shared-save");
    Trainer first(identity_recipe({"save=" + save}), {test::temp_dir("first"), "", Device::CPU});
    const std::string msg = test::error_of([&] {
        Trainer second(identity_recipe({"save=" + save}),
                       {test::temp_dir("second"), "", Device::CPU});
    });
    EXPECT_NE(msg.find("save directory '" + save + "' is in use by another run (PID " +
                       std::to_string(::getpid())),
              std::string::npos)
        << msg;
    // `save` equal to --out: one lock, not a conflict with itself.
    const std::string same = test::temp_dir("save-is-out");
    EXPECT_NO_THROW(Trainer t(identity_recipe({"save=" + same}), {same, "", Device::CPU}));
}

// An empty or cut recipe.yaml in a checkpoint, or a recipe path that is a directory or an empty
// file, stops the command (each trained the built-in defaults with exit 0).
TEST(CheckpointIdentity, CutOrEmptyRecipesAreRefused) {
    const std::string save = saved_run_dir(test::temp_dir("cut-recipe"));
    const std::string recipe = save + "/iter_0000004/recipe.yaml";
    const std::string original = test::read_text(recipe);
    // Empty, or cut at a line's end (cut inside a line, the broken key is named instead).
    for (const std::string& text :
         {std::string(), original.substr(0, original.rfind('\n', original.size() / 2) + 1)}) {
        put_bytes(recipe, text);
        const test::CliRun r = test::run_cli("train -q --no-save --resume " + save + " --out " +
                                             test::temp_dir("cut-resume"));
        EXPECT_EQ(r.code, 1) << r.output;
        EXPECT_NE(r.output.find(recipe + " lacks"), std::string::npos) << r.output;
    }
    put_bytes(recipe, original);
    const std::string dir = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/";
    for (const std::string& cmd :
         {"train -q --no-save --out " + test::temp_dir("dir-recipe") + " --recipe " + dir,
          "plan --recipe " + dir,
          "train -q --no-save --out " + test::temp_dir("dir-recipe") + " --recipe " + dir +
              "tiny.yaml," + dir}) {
        const test::CliRun r = test::run_cli(cmd);
        EXPECT_EQ(r.code, 1) << cmd << "\n" << r.output;
        EXPECT_NE(r.output.find("' is a directory: give a recipe's .yaml file"), std::string::npos)
            << r.output;
    }
    const std::string empty = test::temp_dir("empty-recipe") + "/empty.yaml";
    std::ofstream(empty) << "# nothing set\n";
    const test::CliRun r = test::run_cli("plan --recipe " + empty);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("sets no key (it is empty or all comments)"), std::string::npos)
        << r.output;
}

// A trainer state whose data position lies outside the data is named (pending_offset -5 hit an
// internal assertion).
TEST(CheckpointIdentity, ADataPositionOutsideTheDataIsNamed) {
    const std::string save = saved_run_dir(test::temp_dir("pending"));
    const std::string ckpt = save + "/iter_0000004", state = ckpt + "/trainer_state.json";
    std::string text = test::read_text(state);
    const size_t ds = text.find("\"pending_dataset\": ");
    const size_t off = text.find("\"pending_offset\": ");
    ASSERT_NE(ds, std::string::npos);
    ASSERT_NE(off, std::string::npos);
    text.replace(off, text.find_first_of(",\n}", off) - off, "\"pending_offset\": -5");
    const size_t ds2 = text.find("\"pending_dataset\": ");
    text.replace(ds2, text.find_first_of(",\n}", ds2) - ds2, "\"pending_dataset\": 0");
    put_bytes(state, text);
    const std::string msg = identity_resume_error(ckpt);
    EXPECT_NE(msg.find(state + ": data position: pending_offset -5 is outside"), std::string::npos)
        << msg;
}

// Resuming with fewer MTP layers or without DSA would drop trained tensors: refused, naming them.
TEST(CheckpointIdentity, AResumeThatDropsTrainedWeightsIsRefused) {
    const std::string save = saved_run_dir(test::temp_dir("drop"));
    const std::string ckpt = save + "/iter_0000004";
    for (const char* set : {"mtp_num_layers=0", "experimental_attention_variant=none"}) {
        const std::string msg = identity_resume_error(ckpt, {set});
        EXPECT_NE(msg.find("trained tensors that this recipe's model has no parameter for"),
                  std::string::npos)
            << set << ": " << msg;
    }
}

// Trimming metrics.jsonl on resume writes a new file and renames it: the old file's bytes are
// never rewritten in place (a kill mid-rewrite truncated a 300,000-line log).
TEST(MetricsLog, TrimWritesANewFileAndRenames) {
    const std::string dir = test::temp_dir("metrics-trim");
    const std::string path = dir + "/metrics.jsonl", held = dir + "/held.jsonl";
    {
        std::ofstream out(path);
        for (int s = 1; s <= 10; ++s) out << "{\"step\": " << s << ", \"lm_loss\": 1.0}\n";
        out << "{\"step\": 11, \"lm_lo";  // a line a crash cut short
    }
    fs::create_hard_link(path, held);  // the old file, whatever happens to the name
    const std::string before = test::read_text(path);
    trim_metrics_log(path, 4);
    EXPECT_EQ(test::read_text(held), before) << "the old file was rewritten in place";
    std::string kept;
    for (int s = 1; s <= 4; ++s)
        kept += "{\"step\": " + std::to_string(s) + ", \"lm_loss\": 1.0}\n";
    EXPECT_EQ(test::read_text(path), kept);
    EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// A dataset cut while a run reads it: the read names the file (it died of SIGBUS).
TEST(IndexedDatasetReads, AFileCutDuringTheRunIsNamed) {
    const std::string prefix = test::temp_dir("cut-bin") + "/docs";
    {
        IndexedDatasetWriter w(prefix, TokenCode::U16);
        for (int d = 0; d < 4; ++d) w.add_document(std::vector<int32_t>(1000, d + 1));
        w.finish();
    }
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.sequence(3).front(), 4);
    fs::resize_file(prefix + ".bin", 100);
    const std::string msg = test::error_of([&] { ds.sequence(3); });
    EXPECT_NE(msg.find(prefix + ".bin' is 100 bytes now, but the run reads bytes 6000..8000"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("the file changed during the run"), std::string::npos) << msg;
}
