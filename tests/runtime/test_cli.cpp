// The `sparsetron` executable: exit codes and messages a user sees.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"
#include "sparsetron/data/indexed_dataset.h"
#include "sparsetron/io/checkpoint_identity.h"
#include "test_util.h"

namespace {
using sparsetron::test::CliRun;
using sparsetron::test::read_text;
CliRun run(const std::string& args) {
    return sparsetron::test::run_cli(args);
}
}  // namespace

TEST(Cli, HelpListsEverySubcommand) {
    CliRun r = run("--help");
    EXPECT_EQ(r.code, 0);
    for (const char* sub : {"train", "eval", "plan", "preprocess", "keys", "info"})
        EXPECT_NE(r.output.find(sub), std::string::npos) << sub;
    CliRun t = run("train --help");
    for (const char* opt : {"--recipe", "--set", "--out", "--resume", "--device"})
        EXPECT_NE(t.output.find(opt), std::string::npos) << opt;
}

// `info` lists every environment variable the engine reads (core/env.h) with its value.
TEST(Cli, InfoListsTheEnvironmentVariablesRead) {
    CliRun r = run("info");
    EXPECT_EQ(r.code, 0);
    for (const sparsetron::EnvVar& v : sparsetron::env_vars())
        EXPECT_NE(r.output.find(v.name), std::string::npos) << v.name << "\n" << r.output;
    r = sparsetron::test::run_cli("info", "SPARSETRON_DATA_DIR=/some/corpus");
    EXPECT_NE(r.output.find("/some/corpus"), std::string::npos) << r.output;
}

TEST(Env, ReadingAnUnregisteredVariableIsABug) {
    EXPECT_THROW(sparsetron::env_value("SPARSETRON_SOMETHING_ELSE"), sparsetron::Error);
    setenv("SPARSETRON_CHARTJS", "", 1);
    EXPECT_FALSE(sparsetron::env_value("SPARSETRON_CHARTJS").has_value()) << "empty = unset";
    setenv("SPARSETRON_CHARTJS", "/x/chart.umd.js", 1);
    EXPECT_EQ(sparsetron::env_value("SPARSETRON_CHARTJS").value_or(""), "/x/chart.umd.js");
    unsetenv("SPARSETRON_CHARTJS");
}

TEST(Cli, BadInputsExitNonZeroWithOneClearMessage) {
    CliRun r = run("train --set hiden_size=64 --quiet");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("error: --set: unknown recipe key 'hiden_size' (did you mean "
                            "'hidden_size'?)"),
              std::string::npos)
        << r.output;
    r = run("train --recipe /nonexistent.yaml");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find("/nonexistent.yaml"), std::string::npos) << r.output;
    r = run("eval --model /nonexistent --tokens /nonexistent");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("cannot read token file '/nonexistent'"), std::string::npos)
        << r.output;
    r = run("plan --set num_attention_heads=0");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("'num_attention_heads' must be > 0"), std::string::npos) << r.output;
    // The key named, not a later symptom ("checkpoint directory does not exist", "no loss
    // targets": the data blamed).
    r = run("train --set train_iters=0 --no-save -q");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("'train_iters' is 0: a run trains at least one step"),
              std::string::npos)
        << r.output;
    r = run("train --set seq_length=1 --no-save -q");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("'seq_length' is 1: a sample needs at least 2 tokens"),
              std::string::npos)
        << r.output;
}

TEST(Cli, PreprocessTrainEvalAndPlan) {
    std::string dir = sparsetron::test::temp_dir("cli");
    {
        std::ofstream f(dir + "/text.txt");
        for (int i = 0; i < 60; ++i)
            f << "The quick brown fox " << i << " jumps over the lazy dog.\n\n";
    }
    CliRun pre = run("preprocess --input " + dir + "/text.txt --output-prefix " + dir + "/ds");
    ASSERT_EQ(pre.code, 0) << pre.output;
    EXPECT_NE(pre.output.find("60 documents"), std::string::npos) << pre.output;
    CliRun train = run("train --out " + dir + "/run --set data_path=" + dir +
                       "/ds --set train_iters=2 "
                       "--set seq_length=64 --set global_batch_size=2"
                       " --set recompute_granularity=selective");
    ASSERT_EQ(train.code, 0) << train.output;
    // A CUDA memory setting on the CPU backend is said to be one, not silently dropped.
    EXPECT_NE(train.output.find("selective recompute: core_attn (applies on --device cuda; the CPU "
                                "backend keeps every activation)"),
              std::string::npos)
        << train.output;
    EXPECT_NE(train.output.find("checkpoint: " + dir + "/run/checkpoints/iter_0000002"),
              std::string::npos)
        << train.output;
    std::ifstream metrics(dir + "/run/metrics.jsonl");
    std::string line;
    int lines = 0;
    while (std::getline(metrics, line)) {
        auto j = nlohmann::json::parse(line);
        for (const char* k :
             {"step", "lm_loss", "total_loss", "lr", "grad_norm", "tokens", "step_ms"})
            EXPECT_TRUE(j.contains(k)) << k;
        ++lines;
    }
    EXPECT_EQ(lines, 2);
    std::ofstream(dir + "/tokens.txt") << "84 104 101 32 113\n\n102 111 120 256\n";
    CliRun ev =
        run("eval --model " + dir + "/run/checkpoints --tokens " + dir + "/tokens.txt --json");
    ASSERT_EQ(ev.code, 0) << ev.output;
    auto j = nlohmann::json::parse(ev.output);
    EXPECT_EQ(j["targets"].get<int>(), 4 + 3);
    EXPECT_GT(j["lm_loss"].get<double>(), 0.0);
    {
        // A checkpoint of a pipeline-parallel run (its recipe's layout: 2 stages over 2 ranks)
        // evaluates on one process, to the same loss: the weights are the same tensors.
        const std::string ckpt = dir + "/run/checkpoints/iter_0000002";
        std::ifstream in(ckpt + "/recipe.yaml");
        std::string yaml((std::istreambuf_iterator<char>(in)), {});
        for (const auto& [from, to] :
             {std::pair<std::string, std::string>{"\npipeline_model_parallel_size: 1\n",
                                                  "\npipeline_model_parallel_size: 2\n"},
              {"\nworld_size: 1\n", "\nworld_size: 2\n"}}) {
            const size_t at = yaml.find(from);
            ASSERT_NE(at, std::string::npos) << from;
            yaml.replace(at, from.size(), to);
        }
        std::filesystem::copy(ckpt, dir + "/pp-ckpt", std::filesystem::copy_options::recursive);
        std::ofstream(dir + "/pp-ckpt/recipe.yaml") << yaml;
        // The edited recipe's digest recorded, as the pipeline run's save would have.
        const std::string state_path = dir + "/pp-ckpt/trainer_state.json";
        std::ifstream state_in(state_path);
        nlohmann::json state = nlohmann::json::parse(state_in);
        state["files"] = sparsetron::checkpoint_file_digests(dir + "/pp-ckpt");
        std::ofstream(state_path) << state.dump(2);
        CliRun pp = run("eval --model " + dir + "/pp-ckpt --tokens " + dir + "/tokens.txt --json");
        ASSERT_EQ(pp.code, 0) << pp.output;
        EXPECT_EQ(nlohmann::json::parse(pp.output)["lm_loss"].get<double>(),
                  j["lm_loss"].get<double>());
    }
    // Resuming to a later iteration continues the metrics file.
    CliRun more =
        run("train --resume " + dir + "/run/checkpoints --out " + dir + "/run --set train_iters=3");
    ASSERT_EQ(more.code, 0) << more.output;
    EXPECT_NE(more.output.find("resumed at iteration 2"), std::string::npos) << more.output;
    // A checkpoint's recipe whose layout does not fit the launch: the error says how to override.
    CliRun layout = run("train --resume " + dir + "/run/checkpoints --out " + dir +
                        "/run-ep --set train_iters=4 --set expert_model_parallel_size=2");
    EXPECT_NE(layout.code, 0);
    EXPECT_NE(layout.output.find("must divide world_size"), std::string::npos) << layout.output;
    EXPECT_NE(layout.output.find("override its layout with --set"), std::string::npos)
        << layout.output;
    CliRun plan = run("plan --set optimizer=muon --set muon_split_qkv_per_head=true");
    EXPECT_EQ(plan.code, 0);
    // Each parameter with its optimizer, split and state size.
    EXPECT_NE(plan.output.find("model.layers.0.self_attn.q_b_proj.weight"), std::string::npos);
    EXPECT_NE(plan.output.find("per_head x8"), std::string::npos) << plan.output;
    EXPECT_NE(plan.output.find("lm_head.weight"), std::string::npos);
    EXPECT_NE(plan.output.find("buffer"), std::string::npos);  // the expert bias
    EXPECT_NE(plan.output.find("activations"), std::string::npos);
    EXPECT_NE(plan.output.find("total"), std::string::npos);
    // The per-layer kinds summed: the tiny recipe's two layers' inputs are one kind.
    EXPECT_NE(plan.output.find("largest kinds of buffer"), std::string::npos) << plan.output;
    EXPECT_NE(plan.output.find("layers.*."), std::string::npos) << plan.output;
    EXPECT_EQ(plan.output.find("parallel layout"), std::string::npos);
    // A multi-GPU recipe's layout is printed, and the plan is one rank's.
    CliRun wide =
        run("plan --set world_size=8 --set global_batch_size=8 "
            "--set expert_model_parallel_size=4 --set context_parallel_size=2");
    ASSERT_EQ(wide.code, 0) << wide.output;
    EXPECT_NE(wide.output.find("parallel layout: 8 ranks: DP 4 x CP 2 (dense), EP 4 x EDP 2"),
              std::string::npos)
        << wide.output;
    // Experts sharded: EP rank 0 of 4 holds expert 0 of the 4 (each layer), not expert 1.
    EXPECT_NE(wide.output.find("each plan below is of its stage's first rank"), std::string::npos)
        << wide.output;
    EXPECT_NE(wide.output.find("mlp.experts.0.gate_proj.weight"), std::string::npos);
    EXPECT_EQ(wide.output.find("mlp.experts.1.gate_proj.weight"), std::string::npos);
    // --world-rank: that rank's plan (on CUDA its share of the distributed optimizer, named); a
    // rank beyond world_size is refused.
    const std::string layout8 =
        "plan --set world_size=8 --set global_batch_size=8 --set use_distributed_optimizer=true";
    CliRun rank3 = run(layout8 + " --world-rank 3");
    ASSERT_EQ(rank3.code, 0) << rank3.output;
    EXPECT_NE(rank3.output.find("each plan below is rank 3's"), std::string::npos) << rank3.output;
#if SPARSETRON_WITH_CUDA
    CliRun cuda3 = run(layout8 + " --world-rank 3 --device cuda");
    ASSERT_EQ(cuda3.code, 0) << cuda3.output;
    EXPECT_NE(cuda3.output.find("the distributed optimizer keeps a rank's share of the fp32 "
                                "masters and optimizer state, over the 8 ranks"),
              std::string::npos)
        << cuda3.output;
#endif
    // --every-rank: one line per group of ranks, and the largest, which is that rank's own
    // plan's total (on CUDA each rank's share of the distributed optimizer differs).
    CliRun every = run(layout8 + " --every-rank");
    ASSERT_EQ(every.code, 0) << every.output;
    EXPECT_NE(every.output.find("host plan of every rank"), std::string::npos) << every.output;
    EXPECT_NE(every.output.find("ranks 0-7: "), std::string::npos) << every.output;
#if SPARSETRON_WITH_CUDA
    CliRun every_cuda = run(layout8 + " --every-rank --device cuda");
    ASSERT_EQ(every_cuda.code, 0) << every_cuda.output;
    const size_t at = every_cuda.output.find("largest: rank ");
    ASSERT_NE(at, std::string::npos) << every_cuda.output;
    const int largest = std::stoi(every_cuda.output.substr(at + 14));
    const std::string size = every_cuda.output.substr(
        every_cuda.output.find(", ", at) + 2,
        every_cuda.output.find('\n', at) - every_cuda.output.find(", ", at) - 2);
    CliRun own = run(layout8 + " --device cuda --world-rank " + std::to_string(largest));
    ASSERT_EQ(own.code, 0) << own.output;
    const size_t total_at = own.output.find("\ntotal ");
    ASSERT_NE(total_at, std::string::npos) << own.output;
    const std::string total =
        own.output.substr(total_at + 1, own.output.find('\n', total_at + 1) - total_at - 1);
    EXPECT_EQ(total.substr(total.size() - size.size()), size) << total << "\n" << every_cuda.output;
#endif
    CliRun rank8 = run(layout8 + " --world-rank 8");
    EXPECT_EQ(rank8.code, 1) << rank8.output;
    EXPECT_NE(rank8.output.find("--world-rank 8: the recipe's world_size is 8"), std::string::npos)
        << rank8.output;
    // CP 2: a rank plans its rows (< 256 / 2 + 2 x 4 documents) of 256-row micro-batches.
    EXPECT_NE(wide.output.find("this rank computes 136 rows of micro-batches of 256 key rows"),
              std::string::npos)
        << wide.output;
    // Pipeline stages: one plan each, holding its layers; the embedding on the first, the head
    // on the last.
    CliRun staged =
        run("plan --set world_size=2 --set num_layers=4 --set moe_layer_freq=[0,1,1,1] "
            "--set pipeline_model_parallel_size=2 --set decoder_first_pipeline_num_layers=1 "
            "--set dsa_indexer_skip_topk_offset=2");
    ASSERT_EQ(staged.code, 0) << staged.output;
    const size_t s0 = staged.output.find(
                     "== pipeline stage 0 of 2: decoder layers 0-0, the "
                     "embedding =="),
                 s1 = staged.output.find(
                     "== pipeline stage 1 of 2: decoder layers 1-3, the "
                     "final norm, head, losses and MTP ==");
    ASSERT_NE(s0, std::string::npos) << staged.output;
    ASSERT_NE(s1, std::string::npos) << staged.output;
    const std::string first = staged.output.substr(s0, s1 - s0), last = staged.output.substr(s1);
    EXPECT_NE(first.find("model.layers.0.self_attn.q_b_proj.weight"), std::string::npos);
    EXPECT_EQ(first.find("model.layers.1."), std::string::npos) << first;
    EXPECT_EQ(first.find("lm_head.weight"), std::string::npos) << first;
    EXPECT_NE(last.find("model.layers.3.self_attn.q_b_proj.weight"), std::string::npos);
    EXPECT_EQ(last.find("model.layers.0."), std::string::npos) << last;
    EXPECT_NE(last.find("lm_head.weight"), std::string::npos) << last;
    // Interleaved: each pipeline rank plans its two chunks (rank 0 layers 0 and 2, rank 1
    // layers 1 and 3 with the head), also as every rank's total, and over lengths the whole
    // model's plan, on CPU and CUDA.
    const std::string vpp =
        "plan --set world_size=2 --set num_layers=4 --set moe_layer_freq=[0,1,1,1] "
        "--set pipeline_model_parallel_size=2 --set num_virtual_stages_per_pipeline_rank=2 "
        "--set dsa_indexer_topk_freq=1";
    CliRun chunks = run(vpp);
    ASSERT_EQ(chunks.code, 0) << chunks.output;
    const size_t c0 = chunks.output.find(
                     "== pipeline stage 0 of 2: stage 0: decoder layers 0-0, the embedding; "
                     "stage 2: decoder layers 2-2 =="),
                 c1 = chunks.output.find(
                     "== pipeline stage 1 of 2: stage 1: decoder layers 1-1; stage 3: decoder "
                     "layers 3-3, the final norm, head, losses and MTP ==");
    ASSERT_NE(c0, std::string::npos) << chunks.output;
    ASSERT_NE(c1, std::string::npos) << chunks.output;
    const std::string rank0 = chunks.output.substr(c0, c1 - c0);
    EXPECT_NE(rank0.find("model.layers.2.self_attn.q_b_proj.weight"), std::string::npos) << rank0;
    EXPECT_EQ(rank0.find("model.layers.1."), std::string::npos) << rank0;
    // --every-rank: each pipeline rank's two chunks, each total the one --world-rank prints.
    CliRun vpp_every = run(vpp + " --every-rank");
    ASSERT_EQ(vpp_every.code, 0) << vpp_every.output;
    for (int r = 0; r < 2; ++r) {
        CliRun one = run(vpp + cat(" --world-rank ", r));
        ASSERT_EQ(one.code, 0) << one.output;
        const size_t t = one.output.rfind("\ntotal");
        ASSERT_NE(t, std::string::npos) << one.output;
        const size_t v0 = one.output.find_first_not_of(' ', t + 6), v1 = one.output.find('\n', v0);
        const std::string total = one.output.substr(v0, v1 - v0);
        EXPECT_NE(vpp_every.output.find(cat("rank ", r, " (stage ", r, "): ", total)),
                  std::string::npos)
            << "rank " << r << " planned " << total << " alone:\n"
            << vpp_every.output;
    }
    // --lengths: the whole model's plan, as with one stage per rank.
    CliRun lengths = run(vpp + " --lengths 64,128");
    EXPECT_EQ(lengths.code, 0) << lengths.output;
    EXPECT_NE(lengths.output.find("the whole model's"), std::string::npos) << lengths.output;
#if SPARSETRON_WITH_CUDA
    // The device plan of a rank's two chunks: both chunks' layers' activations, forward messages
    // for the chunks past the first stage, and each rank's total as --every-rank prints it.
    CliRun vpp_every_cuda = run(vpp + " --every-rank --device cuda");
    ASSERT_EQ(vpp_every_cuda.code, 0) << vpp_every_cuda.output;
    for (int r = 0; r < 2; ++r) {
        CliRun one = run(vpp + cat(" --device cuda --top 400 --world-rank ", r));
        ASSERT_EQ(one.code, 0) << one.output;
        for (int l : {r, r + 2})
            EXPECT_NE(one.output.find(cat("layers.", l, ".x_in")), std::string::npos)
                << "rank " << r << " layer " << l << ":\n"
                << one.output;
        EXPECT_EQ(one.output.find(cat("model.layers.", 1 - r, ".")), std::string::npos)
            << one.output;
        EXPECT_NE(one.output.find("pipeline.forward_messages"), std::string::npos) << one.output;
        const size_t t = one.output.find("\ntotal");
        ASSERT_NE(t, std::string::npos) << one.output;
        const size_t v0 = one.output.find_first_not_of(' ', t + 6), v1 = one.output.find('\n', v0);
        EXPECT_NE(vpp_every_cuda.output.find(
                      cat("rank ", r, " (stage ", r, "): ", one.output.substr(v0, v1 - v0))),
                  std::string::npos)
            << one.output << vpp_every_cuda.output;
    }
    CliRun lengths_cuda = run(vpp + " --lengths 64,128 --device cuda");
    EXPECT_EQ(lengths_cuda.code, 0) << lengths_cuda.output;
#endif
}

namespace {

int metric_lines(const std::string& path) {
    std::ifstream in(path);
    int n = 0;
    for (std::string line; std::getline(in, line);) n += !line.empty();
    return n;
}
}  // namespace

// Resuming without --out continues in the directory resumed from (it wrote into ./runs/tiny,
// splicing two runs' metrics there and leaving the resumed directory behind).
TEST(Cli, ResumeWithoutOutContinuesWhereItResumedFrom) {
    namespace fs = std::filesystem;
    const std::string out = sparsetron::test::temp_dir("resume-here");
    CliRun first =
        run("train --set train_iters=2 --out " + out + sparsetron::test::small_run_cli());
    ASSERT_EQ(first.code, 0) << first.output;
    const std::string cwd = sparsetron::test::temp_dir("cwd");
    CliRun again =
        sparsetron::test::run_cli("train --resume " + out + "/checkpoints --set train_iters=4" +
                                      sparsetron::test::small_run_cli(),
                                  "--chdir=" + cwd);
    ASSERT_EQ(again.code, 0) << again.output;
    EXPECT_EQ(metric_lines(out + "/metrics.jsonl"), 4) << again.output;
    EXPECT_TRUE(fs::exists(out + "/checkpoints/iter_0000004/model.safetensors"));
    EXPECT_FALSE(fs::exists(cwd + "/runs")) << "the resumed run wrote into the working directory";
}

// The seed's timed window on a training run: `--timed-window 1,2` over 4 steps measures steps 2
// and 3, prints their figures at the end and writes timed_window.json (positive audited TFLOPS:
// the step's documents counted); a malformed window is refused naming the option.
TEST(Cli, TrainTimedWindowReportsTheMeasuredSteps) {
    const std::string out = sparsetron::test::temp_dir("timed-window");
    CliRun r = run("train --set train_iters=4 --no-save --timed-window 1,2 --out " + out +
                   sparsetron::test::small_run_cli());
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("timed window (steps 2-3 of the run): median "), std::string::npos)
        << r.output;
    const auto j = nlohmann::json::parse(read_text(out + "/timed_window.json"));
    EXPECT_EQ(j["warmup_steps"], 1);
    EXPECT_EQ(j["measured_steps"], 2);
    EXPECT_TRUE(j["complete"].get<bool>());
    EXPECT_GT(j["median_ms"].get<double>(), 0);
    EXPECT_GT(j["tflops_per_gpu"].get<double>(), 0);
    ASSERT_EQ(j["flops_per_step"].size(), 2u);
    EXPECT_GT(j["flops_per_step"][0].get<double>(), 0);
    CliRun bad = run("train --set train_iters=1 --no-save --timed-window 8 --out " + out +
                     sparsetron::test::small_run_cli());
    EXPECT_NE(bad.code, 0);
    EXPECT_NE(bad.output.find("--timed-window"), std::string::npos) << bad.output;
}

// Validation from the command line: split + eval_interval + eval_iters print a validation
// line and put valid_lm_loss into metrics.jsonl at steps 2 and 4; `eval --data` scores the held-out
// part of the run's split (read from the checkpoint's recipe), and an empty part is refused.
TEST(Cli, ValidationDuringTrainingAndEvalOnTheHeldOutPart) {
    const std::string out = sparsetron::test::temp_dir("validation");
    CliRun r =
        run("train --set train_iters=4 --set split=80,20,0 --set eval_interval=2 --set eval_iters=1"
            " --out " +
            out + sparsetron::test::small_run_cli());
    ASSERT_EQ(r.code, 0) << r.output;
    std::ifstream in(out + "/metrics.jsonl");
    std::vector<bool> valid;
    for (std::string line; std::getline(in, line);)
        valid.push_back(line.find("\"valid_lm_loss\"") != std::string::npos);
    EXPECT_EQ(valid, (std::vector<bool>{false, true, false, true}));
    EXPECT_EQ(r.output.find("validation after step"), std::string::npos) << "-q prints none";
    CliRun loud =
        run("train --set train_iters=2 --set split=80,20,0 --set eval_interval=2"
            " --set eval_iters=1 --set global_batch_size=2 --no-save" +
            sparsetron::test::small_model_cli() + " --out " +
            sparsetron::test::temp_dir("validation-loud"));
    ASSERT_EQ(loud.code, 0) << loud.output;
    EXPECT_NE(loud.output.find("validation after step 2 | lm_loss "), std::string::npos)
        << loud.output;
    CliRun e = run("eval --model " + out + "/checkpoints --data " + out + "/data/corpus");
    ASSERT_EQ(e.code, 0) << e.output;
    EXPECT_NE(e.output.find("(the valid part of split 80,20,0)"), std::string::npos) << e.output;
    EXPECT_NE(e.output.find("| mtp_loss "), std::string::npos)
        << "the run's MTP depths: " << e.output;
    CliRun none =
        run("eval --model " + out + "/checkpoints --data " + out + "/data/corpus --part test");
    EXPECT_EQ(none.code, 1) << none.output;
    EXPECT_NE(none.output.find("the test part holds no document"), std::string::npos)
        << none.output;
    CliRun neither = run("eval --model " + out + "/checkpoints");
    EXPECT_EQ(neither.code, 1) << neither.output;
    EXPECT_NE(neither.output.find("give --tokens FILE or --data PREFIX"), std::string::npos)
        << neither.output;
}

// A metrics write that fails stops the run with a message (it exited 0 with the file cut
// short). The resumed run's file-size limit lets it rewrite the first two steps' lines and
// refuses the third (EFBIG, SIGXFSZ ignored as a full disk's ENOSPC would be met).
TEST(Cli, AFailedMetricsWriteStopsTheRun) {
    const std::string out = sparsetron::test::temp_dir("metrics-write");
    CliRun first =
        run("train --set train_iters=2 --out " + out + sparsetron::test::small_run_cli());
    ASSERT_EQ(first.code, 0) << first.output;
    ASSERT_GT(metric_lines(out + "/metrics.jsonl"), 0);
    const std::string cmd = "bash -c \"trap '' XFSZ; ulimit -f 1; exec " +
                            std::string(SPARSETRON_CLI) + " train --no-save --resume " + out +
                            "/checkpoints --set train_iters=6 --out " + out +
                            sparsetron::test::small_run_cli() + "\" 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string output;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) output.append(buf, n);
    const int status = pclose(p);
    EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 1) << output;
    EXPECT_NE(output.find("metrics.jsonl' failed at step"), std::string::npos) << output;
}

// A diverged run (every step after the first skipped for non-finite gradients) stops with an
// error after skipped_iters_limit steps in a row, saving nothing (it ran to the end, exit 0).
TEST(Cli, ADivergedRunStops) {
    const std::string out = sparsetron::test::temp_dir("diverged");
    CliRun r =
        run("train --set lr=1e30 --set min_lr=1e29 --set lr_warmup_iters=0"
            " --set train_iters=20 --set skipped_iters_limit=3 --out " +
            out + sparsetron::test::small_run_cli());
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("3 consecutive steps (2..4) were skipped"), std::string::npos)
        << r.output;
    // Its advice is true: no checkpoint precedes the divergence (it named earlier ones).
    EXPECT_NE(r.output.find("no checkpoint of this run precedes it: start again with a lower lr"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(metric_lines(out + "/metrics.jsonl"), 4);
    EXPECT_FALSE(std::filesystem::exists(out + "/checkpoints/iter_0000004"));
}

namespace {
// Starts `sparsetron ARGS` (output to OUT/log) and waits until OUT/metrics.jsonl has `lines`
// lines; its PID.
pid_t start_run(const std::string& args, const std::string& out, int lines) {
    const pid_t pid = ::fork();
    if (pid == 0) {
        const std::string cmd = std::string(SPARSETRON_CLI) + " " + args + " >" + out + "/log 2>&1";
        ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
        ::_exit(127);
    }
    for (int waited = 0; waited < 6000 && metric_lines(out + "/metrics.jsonl") < lines; ++waited)
        ::usleep(10000);
    return pid;
}

// The exit status of a started run, or -1 when a signal ended it.
int exit_code(pid_t pid) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs `sparsetron ARGS` until OUT/metrics.jsonl has `lines` lines, sends each signal (after the
// first, once the run has said it will stop: standard signals that arrive together are delivered
// once), and returns the exit status.
int signalled_run(const std::string& args, const std::string& out, int lines,
                  const std::vector<int>& signals) {
    const pid_t pid = start_run(args, out, lines);
    for (size_t i = 0; i < signals.size(); ++i) {
        for (int waited = 0; i > 0 && waited < 6000 &&
                             read_text(out + "/log").find("stop requested") == std::string::npos;
             ++waited)
            ::usleep(1000);
        ::kill(pid, signals[i]);
    }
    return exit_code(pid);
}

// The weights of the checkpoint of the last step OUT/metrics.jsonl records.
std::string last_step_checkpoint(const std::string& out) {
    char name[32];
    std::snprintf(name, sizeof name, "iter_%07d", metric_lines(out + "/metrics.jsonl"));
    return out + "/checkpoints/" + name + "/model.safetensors";
}
}  // namespace

// SIGTERM finishes the step in progress, saves it and exits with 143 (the run died with no
// save); a second SIGINT after the first exits at once with 130, saving nothing (the tiny
// recipe's steps take long enough for it to arrive mid-step).
TEST(Cli, SignalsSaveAndExit) {
    namespace fs = std::filesystem;
    const std::string out = sparsetron::test::temp_dir("sigterm");
    const int code = signalled_run(
        "train --set train_iters=1000 --out " + out + sparsetron::test::small_run_cli(), out, 2,
        {SIGTERM});
    const std::string text = read_text(out + "/log");
    EXPECT_EQ(code, 143) << text;
    EXPECT_GE(metric_lines(out + "/metrics.jsonl"), 2);
    EXPECT_TRUE(fs::exists(last_step_checkpoint(out))) << last_step_checkpoint(out);
    EXPECT_NE(text.find("stopped after step"), std::string::npos) << text;

    const std::string twice = sparsetron::test::temp_dir("sigint-twice");
    const int code2 =
        signalled_run("train --set train_iters=1000 -q --out " + twice, twice, 1, {SIGINT, SIGINT});
    EXPECT_EQ(code2, 130) << read_text(twice + "/log");
    EXPECT_FALSE(fs::exists(twice + "/checkpoints/latest_checkpointed_iteration.txt"))
        << read_text(twice + "/log");
}

// SIGHUP (the terminal or session closed) stops like SIGTERM: the step finishes, is saved, and
// the run exits with 129 naming the signal (it used to die at once, saving nothing).
TEST(Cli, AHangupSavesAndExits) {
    namespace fs = std::filesystem;
    const std::string out = sparsetron::test::temp_dir("sighup");
    const int code = signalled_run(
        "train --set train_iters=1000 --out " + out + sparsetron::test::small_run_cli(), out, 2,
        {SIGHUP});
    const std::string text = read_text(out + "/log");
    EXPECT_EQ(code, 128 + SIGHUP) << text;
    const int steps = metric_lines(out + "/metrics.jsonl");
    EXPECT_TRUE(fs::exists(last_step_checkpoint(out))) << text;
    EXPECT_NE(text.find("stopped after step " + std::to_string(steps) + " (SIGHUP)"),
              std::string::npos)
        << text;
}

// `sparsetron stop OUT` asks the run writing OUT to stop like SIGTERM does (the step is saved,
// exit 143), naming the process it signalled; with no run left it signals nothing.
TEST(Cli, StopAsksTheRunToSaveAndExit) {
    namespace fs = std::filesystem;
    const std::string out = sparsetron::test::temp_dir("stop");
    const pid_t pid = start_run(
        "train --set train_iters=1000 --out " + out + sparsetron::test::small_run_cli(), out, 2);
    const sparsetron::test::CliRun stop = sparsetron::test::run_cli("stop " + out);
    EXPECT_EQ(stop.code, 0) << stop.output;
    EXPECT_NE(stop.output.find("sent SIGTERM to rank 0 (PID " + std::to_string(pid) + ")"),
              std::string::npos)
        << stop.output;
    const int code = exit_code(pid);
    const std::string text = read_text(out + "/log");
    EXPECT_EQ(code, 143) << text;
    EXPECT_TRUE(fs::exists(last_step_checkpoint(out))) << text;
    const sparsetron::test::CliRun again = sparsetron::test::run_cli("stop " + out);
    EXPECT_EQ(again.code, 1) << again.output;
    EXPECT_NE(again.output.find("it has ended"), std::string::npos) << again.output;
    const sparsetron::test::CliRun nowhere = sparsetron::test::run_cli("stop " + out + "/none");
    EXPECT_EQ(nowhere.code, 1) << nowhere.output;
    EXPECT_NE(nowhere.output.find("no run has recorded its processes"), std::string::npos)
        << nowhere.output;
}

// `train ... | head -5`: when the reader of stdout goes away, the run finishes its step, saves
// it and says so on stderr, exiting with 141 (it used to die of SIGPIPE with no message and no
// checkpoint; the shell reports 141 either way, so the test checks the save and the message).
TEST(Cli, AClosedOutputPipeSavesAndExits) {
    namespace fs = std::filesystem;
    const std::string out = sparsetron::test::temp_dir("sigpipe");
    const std::string train = std::string(SPARSETRON_CLI) +
                              " train --set train_iters=1000 --set log_interval=1 --out " + out +
                              sparsetron::test::small_model_cli() + " --set global_batch_size=2";
    const std::string cmd = "{ " + train + " 2>" + out + "/err; echo $? >" + out +
                            "/code; } | head -5 >" + out + "/head";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const std::string err = read_text(out + "/err");
    EXPECT_EQ(read_text(out + "/code"), "141\n") << err;
    const int steps = metric_lines(out + "/metrics.jsonl");
    ASSERT_GE(steps, 1) << err;
    EXPECT_LT(steps, 1000) << "the run went on after its reader left";
    EXPECT_TRUE(fs::exists(last_step_checkpoint(out))) << err;
    EXPECT_NE(err.find("stop requested (SIGPIPE"), std::string::npos) << err;
    EXPECT_NE(err.find("stopped after step " + std::to_string(steps) + " (SIGPIPE)"),
              std::string::npos)
        << err;
    EXPECT_NE(err.find("checkpoint: "), std::string::npos) << err;
}

// Token ids of a real vocabulary (GLM's 154880) without a tokenizer: --vocab-size says how many
// there are; without it the byte-level 257 refuses them, naming the option.
TEST(Cli, PreprocessIdsTakeTheVocabularySize) {
    const std::string dir = sparsetron::test::temp_dir("ids");
    std::ofstream(dir + "/ids.txt") << "1 154000 3\n\n70000 5\n";
    CliRun ok = run("preprocess --input-format ids --vocab-size 154880 -i " + dir + "/ids.txt -o " +
                    dir + "/ds");
    ASSERT_EQ(ok.code, 0) << ok.output;
    EXPECT_NE(ok.output.find("2 documents, 5 tokens (token ids below 154880"), std::string::npos)
        << ok.output;
    sparsetron::IndexedDataset ds(dir + "/ds");
    ASSERT_EQ(ds.num_sequences(), 2);
    EXPECT_EQ(ds.sequence(0), (std::vector<int32_t>{1, 154000, 3}));
    EXPECT_EQ(ds.sequence(1), (std::vector<int32_t>{70000, 5}));
    CliRun bytes = run("preprocess --input-format ids -i " + dir + "/ids.txt -o " + dir + "/b");
    EXPECT_EQ(bytes.code, 1) << bytes.output;
    EXPECT_NE(bytes.output.find("\"154000\" is not a token id below the vocabulary size 257 "
                                "(preprocess takes it from --vocab-size or --tokenizer)"),
              std::string::npos)
        << bytes.output;
    CliRun small = run("preprocess --input-format ids --vocab-size 100000 -i " + dir +
                       "/ids.txt -o " + dir + "/c");
    EXPECT_EQ(small.code, 1) << small.output;
}
