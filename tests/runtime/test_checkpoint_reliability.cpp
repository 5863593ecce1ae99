// Checkpoints a run never destroys: retention deletes only the run's own older checkpoints (by
// iteration number, never what it resumed from or what another run wrote), one run per output
// directory, half-done saves of killed runs removed at start, `latest` always loadable.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/crc32c.h"
#include "sparsetron/core/stop_request.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/io/run_lock.h"
#include "sparsetron/io/safetensors.h"
#include "sparsetron/runtime/host_memory_check.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

Recipe saving_recipe(std::vector<std::string> extra = {}) {
    std::vector<std::string> sets = test::small_model_sets();
    sets.insert(sets.end(),
                {"global_batch_size=2", "train_iters=4", "lr_warmup_iters=1", "save_interval=2"});
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
    Trainer t(saving_recipe({"save_keep_last=1"}), {out, "", Device::CPU});
    t.run();
    EXPECT_EQ(iterations_in(t.checkpoint_dir()),
              (std::vector<std::string>{"iter_0000004", "iter_0000100"}));
    EXPECT_EQ(resolve_checkpoint(t.checkpoint_dir()), t.checkpoint_dir() + "/iter_0000004");
}

// A resumed run keeps its run id, so retention bounds the checkpoints its earlier parts saved
// too: resumed from iteration 2 with keep_last 2, it deletes 2, 4 and 6 of its first part (each
// resume kept every predecessor's checkpoint: the disk grew without bound).
TEST(CheckpointRetention, AResumedRunPrunesItsPredecessorsCheckpoints) {
    const std::string out = test::temp_dir("retention-resume");
    {
        Trainer t(saving_recipe({"save_keep_last=3", "train_iters=6"}), {out, "", Device::CPU});
        t.run();
        EXPECT_EQ(iterations_in(t.checkpoint_dir()),
                  (std::vector<std::string>{"iter_0000002", "iter_0000004", "iter_0000006"}));
    }
    const std::string from = out + "/checkpoints/iter_0000002";
    Trainer t(saving_recipe({"save_keep_last=2", "train_iters=10"}), {out, from, Device::CPU});
    EXPECT_EQ(t.iteration(), 2);
    t.run();  // saves 4, 6 (again), 8, 10; keeps the run's newest two
    EXPECT_EQ(iterations_in(t.checkpoint_dir()),
              (std::vector<std::string>{"iter_0000008", "iter_0000010"}));
    EXPECT_EQ(resolve_checkpoint(t.checkpoint_dir()), t.checkpoint_dir() + "/iter_0000010");
}

// The probe's case: save_interval 1, stopped by SIGTERM after each step and resumed five times;
// keep_last 2 holds at two checkpoints (it kept 2, 4, 6, 8, 10). Another run's checkpoint in the
// same directory, below this run's iterations, stays.
TEST(CheckpointRetention, StopAndResumeFiveTimesKeepsTheLastK) {
    const std::string out = test::temp_dir("retention-five");
    const fs::path ck = fs::path(out) / "checkpoints";
    const std::string other_out = test::temp_dir("other-run");
    {
        Trainer other(saving_recipe({"train_iters=1", "save_interval=1", "seed=7"}),
                      {other_out, "", Device::CPU});
        other.run();
    }
    for (int part = 0; part < 5; ++part) {
        Trainer t(saving_recipe({"train_iters=20", "save_interval=1", "save_keep_last=2"}),
                  {out, part == 0 ? "" : ck.string(), Device::CPU});
        int steps = 0;
        t.run([&](const StepMetrics&) {
            if (++steps == 2) set_stop_request(SIGTERM);
        });
        set_stop_request(0);
        EXPECT_EQ(t.iteration(), 2 * (part + 1));
        if (part == 1)  // another run's checkpoint below this run's iterations
            fs::copy(fs::path(other_out) / "checkpoints" / "iter_0000001", ck / "iter_0000001",
                     fs::copy_options::recursive);
    }
    EXPECT_EQ(iterations_in(ck.string()),
              (std::vector<std::string>{"iter_0000001", "iter_0000009", "iter_0000010"}));
}

// Retention follows iteration numbers, not names: past 10^7 the 8-digit name sorts before the
// 7-digit one, which deleted the newest checkpoint.
TEST(CheckpointRetention, NumericPastTenMillion) {
    const std::string out = test::temp_dir("retention-1e7");
    Recipe r = saving_recipe();
    auto tp = make_training_plan(r, Device::CPU);
    tp->plan.allocate(Device::CPU);
    tp->cpu_models.front()->bind();
    for (int64_t it : {9999999, 10000000}) {
        TrainerState st;
        st.iteration = it;
        st.data_position = "{}";
        st.run_id = "0123456789abcdef";
        save_checkpoint(out, {1, st.run_id}, r.model, r.to_yaml(), *tp->params, tp->plan,
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
        Trainer first(saving_recipe(), {out, "", Device::CPU});
        const std::string msg = test::error_of([&] {
            Trainer second(saving_recipe(), {out, "", Device::CPU});
        });
        EXPECT_NE(msg.find("is in use by another run (PID " + std::to_string(::getpid())),
                  std::string::npos)
            << msg;
    }
    EXPECT_NO_THROW(Trainer again(saving_recipe(), {out, "", Device::CPU}));
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
    Trainer t(saving_recipe(), {out, "", Device::CPU});
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

namespace {

// A saved tiny checkpoint (2 steps) and its model file's bytes.
std::string saved_checkpoint(const std::string& out) {
    Trainer t(saving_recipe({"train_iters=2"}), {out, "", Device::CPU});
    t.run();
    return resolve_checkpoint(t.checkpoint_dir());
}

void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string load_error(const std::string& ckpt) {
    auto tp = make_training_plan(saving_recipe(), Device::CPU);
    tp->plan.allocate(Device::CPU);
    return test::error_of([&] { load_model_weights(ckpt, *tp->params, tp->plan); });
}

}  // namespace

TEST(Crc32c, KnownAnswerAndContinuation) {
    const std::string s = "123456789";
    EXPECT_EQ(crc32c(s.data(), s.size()), 0xE3069283u);  // the CRC-32C check value
    EXPECT_EQ(crc32c(s.data() + 4, 5, crc32c(s.data(), 4)), 0xE3069283u);
    std::string big(1000, '\0');
    for (size_t i = 0; i < big.size(); ++i) big[i] = char(i * 131 + 7);
    EXPECT_EQ(crc32c(big.data(), big.size()),
              crc32c(big.data() + 333, 667, crc32c(big.data(), 333)));
}

// A flipped bit in a tensor's bytes is found at load, naming the file and the tensor (it loaded
// unnoticed and trained on).
TEST(CheckpointIntegrity, CorruptTensorBytesAreRefused) {
    const std::string ckpt = saved_checkpoint(test::temp_dir("corrupt"));
    EXPECT_EQ(load_error(ckpt), "");
    const std::string file = ckpt + "/model.safetensors";
    std::string bytes = test::read_text(file);
    bytes[bytes.size() - 5] ^= 0x10;  // inside the last tensor's data
    write_bytes(file, bytes);
    const std::string msg = load_error(ckpt);
    EXPECT_NE(msg.find(file + ": tensor '"), std::string::npos) << msg;
    EXPECT_NE(msg.find("is corrupt: its CRC-32C is"), std::string::npos) << msg;
}

// Overlapping data_offsets are refused when the file is opened; an integer tensor where a weight
// belongs names the file and the tensor.
TEST(CheckpointIntegrity, OverlapsAndWrongDtypesAreNamed) {
    const std::string dir = test::temp_dir("overlap");
    const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
    std::string bytes(8, '\0');
    const uint64_t len = header.size();
    std::memcpy(bytes.data(), &len, 8);
    bytes += header + std::string(12, '\1');
    write_bytes(dir + "/x.safetensors", bytes);
    const std::string msg = test::error_of([&] { SafetensorsFile f(dir + "/x.safetensors"); });
    EXPECT_NE(msg.find("tensor 'b' overlaps tensor 'a'"), std::string::npos) << msg;

    const std::string ckpt = saved_checkpoint(test::temp_dir("dtype"));
    const std::string file = ckpt + "/model.safetensors";
    std::string model = test::read_text(file);
    const std::string from = R"("model.norm.weight":{"dtype":"F32")";
    const size_t at = model.find(from);
    ASSERT_NE(at, std::string::npos);
    model.replace(at + from.size() - 4, 3, "I32");  // same length: the header stays valid
    write_bytes(file, model);
    // Without its trainer_state.json (an HF-like directory) the file is read with no digest to
    // compare against (with it, the changed header no longer matches its digest).
    fs::remove(ckpt + "/trainer_state.json");
    const std::string bad = load_error(ckpt);
    EXPECT_NE(bad.find(file + ": tensor 'model.norm.weight': unsupported weight dtype"),
              std::string::npos)
        << bad;
}

// A NaN weight, or a NaN or negative second-moment estimate, is refused at load with the tensor
// named (the run skipped every step and saved the NaN again; exp_avg_sq < 0 put NaN into weights).
TEST(CheckpointIntegrity, NonFiniteStateIsRefusedAtLoad) {
    Recipe r = saving_recipe();
    for (const char* what : {"weight", "exp_avg_sq nan", "exp_avg_sq negative"}) {
        const std::string out = test::temp_dir(what);
        auto tp = make_training_plan(r, Device::CPU);
        tp->plan.allocate(Device::CPU);
        tp->cpu_models.front()->bind();
        tp->params->initialize(tp->plan, 1, r.model.init_method_std, r.model.num_layers);
        std::string name;
        if (std::string(what) == "weight") {
            const ParamInfo& p = tp->params->params().front();
            name = p.name;
            tp->plan.view(p.param_slot).ptr<float>()[3] = std::nanf("");
        } else {
            for (const auto& [n, slot] : tp->optimizer->state_tensors())
                if (n.size() > 11 && n.rfind(".exp_avg_sq") == n.size() - 11) {
                    name = n;
                    tp->plan.view(slot).ptr<float>()[3] =
                        std::string(what) == "exp_avg_sq nan" ? std::nanf("") : -1.0f;
                    break;
                }
        }
        ASSERT_FALSE(name.empty()) << what;
        TrainerState st;
        st.iteration = 1;
        st.data_position = "{}";
        const std::string ckpt = save_checkpoint(out, {}, r.model, r.to_yaml(), *tp->params,
                                                 tp->plan, tp->optimizer.get(), st);
        auto fresh = make_training_plan(r, Device::CPU);
        fresh->plan.allocate(Device::CPU);
        const std::string msg = test::error_of([&] {
            load_model_weights(ckpt, *fresh->params, fresh->plan);
            load_optimizer_state(ckpt, *fresh->params, *fresh->optimizer, fresh->plan);
        });
        EXPECT_NE(msg.find("tensor '" + name + "' holds"), std::string::npos)
            << what << ": " << msg;
        EXPECT_NE(msg.find("at element 3"), std::string::npos) << msg;
        if (std::string(what) != "weight") continue;
        // eval on the NaN weights exits non-zero (it printed {"lm_loss":null} with exit 0).
        std::ofstream(out + "/tokens.txt") << "84 104 101 32 113\n";
        const test::CliRun ev =
            test::run_cli("eval --model " + ckpt + " --tokens " + out + "/tokens.txt --json");
        EXPECT_EQ(ev.code, 1) << ev.output;
        EXPECT_NE(ev.output.find("holds nan"), std::string::npos) << ev.output;
    }
}

// trainer_state.json must describe its checkpoint: an iteration other than the directory's, a
// negative one, or another seed than the recipe's stop the resume (they resumed at 2 on
// iteration-4 weights, or ran steps -4..5 with NaN losses).
TEST(CheckpointIntegrity, TrainerStateIsValidated) {
    const std::string out = test::temp_dir("state");
    {
        Trainer t(saving_recipe(), {out, "", Device::CPU});
        t.run();
    }
    const std::string ckpt = out + "/checkpoints/iter_0000004";
    const std::string state = ckpt + "/trainer_state.json";
    const std::string original = test::read_text(state);
    const auto with = [&](const std::string& from, const std::string& to) {
        std::string text = original;
        const size_t at = text.find(from);
        EXPECT_NE(at, std::string::npos) << from;
        if (at != std::string::npos) text.replace(at, from.size(), to);
        write_bytes(state, text);
    };
    const auto resume_error = [&](std::vector<std::string> extra = {}) {
        return test::error_of([&] {
            Trainer t(saving_recipe(extra), {test::temp_dir("resumed"), ckpt, Device::CPU});
        });
    };
    with("\"iteration\": 4", "\"iteration\": 2");
    std::string msg = resume_error();
    EXPECT_NE(msg.find("iteration 2 but the checkpoint directory is iter_0000004"),
              std::string::npos)
        << msg;
    with("\"iteration\": 4", "\"iteration\": -5");
    msg = resume_error();
    EXPECT_NE(msg.find("must be >= 0"), std::string::npos) << msg;
    write_bytes(state, original);
    EXPECT_EQ(resume_error(), "");
    msg = resume_error({"seed=99"});
    EXPECT_NE(msg.find("but the recipe's seed is 99"), std::string::npos) << msg;
}

// The early host-memory check's bound never exceeds the planned parameter count (so it never
// refuses a model that fits), and covers most of an MoE model.
TEST(HostMemoryCheck, LowerBoundIsBelowThePlannedCount) {
    const std::string dir = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/";
    for (const std::string& recipe :
         {std::string(), dir + "tiny.yaml",
          dir + "glm5.2-16gpu.yaml," + dir + "overlays/cpu-tiny-width.yaml"}) {
        Recipe r = load_recipe(
            recipe, recipe.empty()
                        ? std::vector<std::string>{"num_experts=64"}
                        : std::vector<std::string>{"world_size=1", "expert_model_parallel_size=1",
                                                   "context_parallel_size=1",
                                                   "dynamic_context_parallel=false"});
        auto tp = make_training_plan(r, Device::CPU);
        const int64_t planned = tp->params->total_numel(false);
        const int64_t bound = parameter_count_lower_bound(r.model);
        EXPECT_LE(bound, planned) << recipe;
        EXPECT_GT(bound, planned / 4) << recipe;
    }
}

// A model far beyond host memory stops before planning, with the sizes (it planned for over a
// minute, then failed allocating).
TEST(HostMemoryCheck, HugeModelsStopBeforePlanning) {
    const test::CliRun r = test::run_cli(
        "train --set num_experts=65536 --set moe_ffn_hidden_size=65536 -q --no-save --out " +
        test::temp_dir("huge"));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("the model has at least"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("of host memory, and this machine has"), std::string::npos) << r.output;
}

// A step whose packed micro-batches cannot fit in host memory stops before packing, naming the
// keys (global_batch_size 4194304 planned 34.84 MiB, then failed allocating gigabytes).
TEST(HostMemoryCheck, AStepBeyondHostMemoryStopsBeforePacking) {
    const test::CliRun r = test::run_cli(
        "train --set global_batch_size=16777216 --set seq_length=2048 -q --no-save "
        "--out " +
        test::temp_dir("huge-step"));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("one step packs 16777216 micro-batches of 2048 token slots"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("lower global_batch_size or seq_length"), std::string::npos)
        << r.output;
    // `plan` shows those bytes beside the plan.
    const test::CliRun plan = test::run_cli("plan --set global_batch_size=4194304");
    EXPECT_EQ(plan.code, 0) << plan.output;
    EXPECT_NE(plan.output.find("step: 4194304 micro-batches packed in host memory, 24.16 GiB"),
              std::string::npos)
        << plan.output;
}

// A CPU memory plan beyond host memory stops before it is allocated.
TEST(HostMemoryCheck, ACpuPlanBeyondHostMemoryStopsBeforeAllocating) {
    const test::CliRun r = test::run_cli("train --set seq_length=1048576 -q --no-save --out " +
                                         test::temp_dir("huge-plan"));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("the CPU memory plan (weights, gradients, optimizer state and "
                            "activations) needs"),
              std::string::npos)
        << r.output;
}

// Stopping early saves where it stops: a stop request (what SIGINT/SIGTERM set) after the step
// in progress, exit_interval after a multiple of it; the run then resumes from there.
TEST(StopRequest, StopsAfterTheStepWithACheckpoint) {
    const std::string out = test::temp_dir("stop");
    {
        Trainer t(saving_recipe({"train_iters=6", "save_interval=0"}), {out, "", Device::CPU});
        set_stop_request(SIGTERM);
        const Trainer::End end = t.run();
        set_stop_request(0);
        EXPECT_EQ(end.kind, Trainer::End::Signal);
        EXPECT_EQ(end.signal, SIGTERM);
        EXPECT_EQ(t.iteration(), 1);
        EXPECT_EQ(resolve_checkpoint(t.checkpoint_dir()), t.checkpoint_dir() + "/iter_0000001");
    }
    {
        Trainer t(saving_recipe({"train_iters=6", "save_interval=0", "exit_signal_handler=false"}),
                  {out, out + "/checkpoints", Device::CPU});
        set_stop_request(SIGINT);  // ignored without the handler key
        Trainer::End end = t.run([](const StepMetrics&) {});
        set_stop_request(0);
        EXPECT_EQ(end.kind, Trainer::End::Finished);
        EXPECT_EQ(t.iteration(), 6);
    }
    Trainer t(saving_recipe({"train_iters=6", "save_interval=0", "exit_interval=4"}),
              {test::temp_dir("interval"), "", Device::CPU});
    const Trainer::End end = t.run();
    EXPECT_EQ(end.kind, Trainer::End::ExitInterval);
    EXPECT_EQ(t.iteration(), 4);
    EXPECT_EQ(resolve_checkpoint(t.checkpoint_dir()), t.checkpoint_dir() + "/iter_0000004");
}
