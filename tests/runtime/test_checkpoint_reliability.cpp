// Checkpoints a run never destroys: retention deletes only the run's own older checkpoints (by
// iteration number, never what it resumed from or what another run wrote), one run per output
// directory, half-done saves of killed runs removed at start, `latest` always loadable.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "../test_util.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/io/run_lock.h"
#include "sparsetron/runtime/trainer.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

Recipe small_recipe(std::vector<std::string> extra = {}) {
    std::vector<std::string> sets = {
        "hidden_size=48", "num_attention_heads=2", "q_lora_rank=32", "kv_lora_rank=24",
        "qk_head_dim=16", "qk_pos_emb_head_dim=8", "v_head_dim=16",  "ffn_hidden_size=96",
        "seq_length=64",  "global_batch_size=2",   "train_iters=4",  "lr_warmup_iters=1",
        "save_interval=2"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_recipe("", sets);
}

std::vector<std::string> iterations_in(const std::string& dir) {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir))
        if (e.is_directory() && e.path().filename().string().rfind("iter_", 0) == 0)
            out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
}

// A checkpoint directory another run left (only its name and a marker file matter here).
void foreign_checkpoint(const fs::path& dir) {
    fs::create_directories(dir);
    std::ofstream(dir / "marker") << "another run's checkpoint\n";
}

}  // namespace

// A fresh run into a directory that already holds a higher iteration (another run's) keeps both:
// the alphabetical retention deleted each checkpoint this run wrote and left `latest` dangling.
TEST(CheckpointRetention, AnotherRunsHigherIterationsAreKept) {
    const std::string out = test::temp_dir("retention-foreign");
    foreign_checkpoint(fs::path(out) / "checkpoints" / "iter_0000100");
    Trainer t(small_recipe({"save_keep_last=1"}), {out, "", Device::CPU});
    t.run();
    EXPECT_EQ(iterations_in(t.checkpoint_dir()),
              (std::vector<std::string>{"iter_0000004", "iter_0000100"}));
    EXPECT_EQ(resolve_checkpoint(t.checkpoint_dir()), t.checkpoint_dir() + "/iter_0000004");
}

// Resuming from an earlier checkpoint keeps it: the run deletes only its own older saves.
TEST(CheckpointRetention, TheResumedCheckpointIsKept) {
    const std::string out = test::temp_dir("retention-resume");
    {
        Trainer t(small_recipe({"save_keep_last=3", "train_iters=6"}), {out, "", Device::CPU});
        t.run();
        EXPECT_EQ(iterations_in(t.checkpoint_dir()),
                  (std::vector<std::string>{"iter_0000002", "iter_0000004", "iter_0000006"}));
    }
    const std::string from = out + "/checkpoints/iter_0000002";
    Trainer t(small_recipe({"save_keep_last=2", "train_iters=10"}), {out, from, Device::CPU});
    EXPECT_EQ(t.iteration(), 2);
    t.run();  // saves 4, 6 (again), 8, 10; keeps its newest two
    EXPECT_EQ(iterations_in(t.checkpoint_dir()),
              (std::vector<std::string>{"iter_0000002", "iter_0000008", "iter_0000010"}));
    EXPECT_EQ(resolve_checkpoint(t.checkpoint_dir()), t.checkpoint_dir() + "/iter_0000010");
}

// Retention follows iteration numbers, not names: past 10^7 the 8-digit name sorts before the
// 7-digit one, which deleted the newest checkpoint.
TEST(CheckpointRetention, NumericPastTenMillion) {
    const std::string out = test::temp_dir("retention-1e7");
    Recipe r = small_recipe();
    auto tp = make_training_plan(r);
    tp->plan.allocate(Device::CPU);
    tp->model->bind();
    std::vector<int64_t> written;
    for (int64_t it : {9999999, 10000000}) {
        TrainerState st;
        st.iteration = it;
        st.data_position = "{}";
        save_checkpoint(out, {1, &written}, r.model, r.to_yaml(), tp->model->params(), tp->plan,
                        tp->optimizer.get(), st);
    }
    EXPECT_EQ(iterations_in(out), (std::vector<std::string>{"iter_10000000"}));
    EXPECT_EQ(resolve_checkpoint(out), out + "/iter_10000000");
}

// A second run on the same output directory stops at once, naming the first one's PID; the
// lock goes with the first run.
TEST(RunLock, SecondRunOnOneDirectoryStops) {
    const std::string out = test::temp_dir("run-lock");
    {
        Trainer first(small_recipe(), {out, "", Device::CPU});
        const std::string msg = test::error_of([&] {
            Trainer second(small_recipe(), {out, "", Device::CPU});
        });
        EXPECT_NE(msg.find("is in use by another run (PID " + std::to_string(::getpid())),
                  std::string::npos)
            << msg;
    }
    EXPECT_NO_THROW(Trainer again(small_recipe(), {out, "", Device::CPU}));
    // Another process holding it: a child takes the lock and waits for the parent's signal.
    int ready[2], done[2];
    ASSERT_EQ(::pipe(ready), 0);
    ASSERT_EQ(::pipe(done), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        DirectoryLock held(out);
        char c = 1;
        (void)!::write(ready[1], &c, 1);
        (void)!::read(done[0], &c, 1);
        ::_exit(0);
    }
    char c = 0;
    ASSERT_EQ(::read(ready[0], &c, 1), 1);
    const std::string msg = test::error_of([&] { DirectoryLock mine(out); });
    EXPECT_NE(msg.find("(PID " + std::to_string(child) + ")"), std::string::npos) << msg;
    (void)!::write(done[1], &c, 1);
    int status = 0;
    ::waitpid(child, &status, 0);
    EXPECT_NO_THROW(DirectoryLock mine(out));
}

// Saves a killed run left half-done (their PID gone) are removed when the next run starts; a
// live process's temporary directory and complete checkpoints stay.
TEST(CheckpointRetention, StaleTemporariesAreRemovedAtStart) {
    const std::string out = test::temp_dir("stale-tmp");
    const fs::path ck = fs::path(out) / "checkpoints";
    const pid_t gone = ::fork();
    if (gone == 0) ::_exit(0);
    ::waitpid(gone, nullptr, 0);
    const std::string dead = std::to_string(gone), live = std::to_string(::getpid());
    for (const std::string& name :
         {".tmp-iter_0000002-" + dead, ".old-iter_0000002-" + dead, ".tmp-iter_0000004-" + live})
        foreign_checkpoint(ck / name);
    foreign_checkpoint(ck / "iter_0000001");
    EXPECT_EQ(remove_stale_temporaries(ck.string()), 2);
    EXPECT_FALSE(fs::exists(ck / (".tmp-iter_0000002-" + dead)));
    EXPECT_FALSE(fs::exists(ck / (".old-iter_0000002-" + dead)));
    EXPECT_TRUE(fs::exists(ck / (".tmp-iter_0000004-" + live)));
    EXPECT_TRUE(fs::exists(ck / "iter_0000001" / "marker"));
    // The trainer does it at start.
    foreign_checkpoint(ck / (".tmp-iter_0000006-" + dead));
    Trainer t(small_recipe(), {out, "", Device::CPU});
    EXPECT_FALSE(fs::exists(ck / (".tmp-iter_0000006-" + dead)));
}

// Durable steps fail loudly: syncing or renaming what does not exist names the path.
TEST(Durable, FailuresNameThePath) {
    const std::string dir = test::temp_dir("durable");
    const std::string missing = dir + "/missing";
    EXPECT_NE(test::error_of([&] { sync_path(missing); }).find(missing), std::string::npos);
    std::ofstream(dir + "/a") << "x";
    rename_durably(dir + "/a", dir + "/b");
    EXPECT_TRUE(fs::exists(dir + "/b"));
    EXPECT_FALSE(fs::exists(dir + "/a"));
}
