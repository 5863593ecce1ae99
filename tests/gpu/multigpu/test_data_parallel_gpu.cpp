// Data parallelism over NCCL on two GPUs (label gpu; skips with a message on fewer GPUs): the CLI
// launched as two processes torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT) against
// the same recipe run by one process on one GPU. Every rank packs the whole step and runs half
// of its micro-batches; the engine sums gradients and routing statistics with NCCL before the
// optimizer, so the losses, gradient norms and expert loads must be the one-GPU run's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpu/harness.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

// The CLI next to this test binary (bin/), wherever the build folder was copied.
std::string cli_path() {
    return (fs::canonical("/proc/self/exe").parent_path() / "sparsetron").string();
}

std::vector<nlohmann::json> read_metrics(const std::string& dir) {
    std::vector<nlohmann::json> out;
    std::ifstream f(dir + "/metrics.jsonl");
    for (std::string line; std::getline(f, line);)
        if (!line.empty()) out.push_back(nlohmann::json::parse(line));
    return out;
}

// `ranks` processes of `sparsetron train --device cuda <args>` writing to `out`; returns the
// shell's exit status (non-zero if any rank failed).
int launch(int ranks, const std::string& out, const std::string& args, bool save = false) {
    std::string cmd = "cd " + out + " && ";
    const int port = 21000 + int(::getpid() % 20000);
    for (int r = 0; r < ranks; ++r)
        cmd += "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(ranks) +
               " LOCAL_RANK=" + std::to_string(r) + " MASTER_PORT=" + std::to_string(port) +
               " NCCL_NVLS_ENABLE=0 " + cli_path() + " train --device cuda --quiet " +
               (save ? "" : "--no-save ") + "--out " + out +
               " --set world_size=" + std::to_string(ranks) + " " + args + " > " + out + "/rank" +
               std::to_string(r) + ".log 2>&1 & ";
    cmd += "fail=0; for j in $(jobs -p); do wait $j || fail=1; done; exit $fail";
    return std::system(("bash -c '" + cmd + "'").c_str());
}

std::string tail_of(const std::string& path) {
    std::ifstream f(path);
    std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return s.size() > 3000 ? s.substr(s.size() - 3000) : s;
}

// `two_only`: settings for the two-process run alone (expert or context parallelism).
// `step1_tol`: relative tolerance of step 1's losses (the gradient norm's: 10x); `load_tol`:
// the share of step 1's routed rows that may go to another expert (0: equal loads). `two_gpu`:
// the two-process run's metrics.
void compare_runs(const std::string& tag, const std::string& extra, const std::string& two_only,
                  double step1_tol, double load_tol, std::vector<nlohmann::json>& two_gpu) {
    const std::string args = "--set train_iters=4 --set save_interval=0 " + extra;
    const std::string one = test::temp_dir(tag + "-1gpu"), two = test::temp_dir(tag + "-2gpu");
    ASSERT_EQ(launch(1, one, args), 0) << tail_of(one + "/rank0.log");
    ASSERT_EQ(launch(2, two, args + " " + two_only), 0)
        << tail_of(two + "/rank0.log") << tail_of(two + "/rank1.log");
    const auto a = read_metrics(one), b = read_metrics(two);
    two_gpu = b;
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), 4u);
    for (size_t i = 0; i < a.size(); ++i) {
        const double la = a[i]["lm_loss"], lb = b[i]["lm_loss"];
        const double ga = a[i]["grad_norm"], gb = b[i]["grad_norm"];
        const double ma = a[i]["mtp_loss"], mb = b[i]["mtp_loss"];
        std::cout << "[dp2 " << tag << "] step " << i + 1 << ": lm " << lb << " vs " << la
                  << ", mtp " << mb << " vs " << ma << ", grad_norm " << gb << " vs " << ga
                  << (b[i].value("graph", false) ? " (graph replay)" : "") << std::endl;
        EXPECT_EQ(a[i]["tokens"], b[i]["tokens"]);
        EXPECT_EQ(a[i]["targets"], b[i]["targets"]);
        // Step 1 starts from the same weights: the same forward (loss sums differ only in the
        // order of fp64 additions) and gradients summed in another fp32 order. Later steps
        // carry Adam's amplification of those last bits (m / sqrt(v) of tiny gradients).
        const double tol = i == 0 ? step1_tol : 2e-4;
        EXPECT_NEAR(lb, la, tol * la) << "step " << i + 1;
        EXPECT_NEAR(mb, ma, tol * ma + 1e-9) << "step " << i + 1;
        EXPECT_NEAR(gb, ga, (i == 0 ? std::max(1e-5, 10 * step1_tol) : 2e-3) * ga)
            << "step " << i + 1;
        if (i == 0 && load_tol == 0) {
            EXPECT_EQ(a[i]["moe_load"], b[i]["moe_load"]) << "step 1 expert loads";
        } else if (i == 0) {
            const auto& la_ = a[i]["moe_load"];
            const auto& lb_ = b[i]["moe_load"];
            ASSERT_EQ(la_.size(), lb_.size());
            for (size_t l = 0; l < la_.size(); ++l) {
                int64_t total = 0, moved = 0;
                for (size_t e = 0; e < la_[l].size(); ++e) {
                    const int64_t x = la_[l][e], y = lb_[l][e];
                    total += x, moved += std::abs(x - y);
                }
                int64_t total_b = 0;
                for (const auto& y : lb_[l]) total_b += int64_t(y);
                EXPECT_EQ(total_b, total) << "every row routed";
                EXPECT_LE(double(moved), load_tol * double(total)) << "step 1 expert loads";
            }
        }
    }
}

// A 4-step run `a` (checkpoint at step 2) and a run `b` resumed from it: b's two steps are a's
// steps 3 and 4. Atomics in the embedding and attention backward make two runs differ in the
// last bits; step 3's loss is the saved weights', step 4's follows the restored optimizer state.
void expect_resumed_steps(const std::string& tag, const std::vector<nlohmann::json>& a,
                          const std::vector<nlohmann::json>& b) {
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
        const double la = a[i + 2]["lm_loss"], lb = b[i]["lm_loss"];
        const double ga = a[i + 2]["grad_norm"], gb = b[i]["grad_norm"];
        std::cout << "[" << tag << "] step " << i + 3 << ": lm " << lb << " vs " << la
                  << ", grad_norm " << gb << " vs " << ga << "\n";
        EXPECT_EQ(b[i]["step"], a[i + 2]["step"]);
        EXPECT_NEAR(lb, la, 1e-4 * la) << "step " << i + 3;
        EXPECT_NEAR(gb, ga, 1e-2 * ga) << "step " << i + 3;
    }
}

std::vector<nlohmann::json> compare_with_one_gpu(const std::string& tag, const std::string& extra,
                                                 const std::string& two_only = "",
                                                 double step1_tol = 1e-6, double load_tol = 0) {
    std::vector<nlohmann::json> two_gpu;
    compare_runs(tag, extra, two_only, step1_tol, load_tol, two_gpu);
    return two_gpu;
}

}  // namespace

TEST(DataParallelGpu, TwoGpusMatchOneGpuEagerAndGraph) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    // overlap_grad_reduce (the default): buckets reduced on a side stream during the last
    // micro-batch's backward; a bucket reduced before its gradients are complete shows here.
    compare_with_one_gpu("eager", "");
    compare_with_one_gpu("graph",
                         "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1");
    compare_with_one_gpu("no-overlap", "--set overlap_grad_reduce=false");
}

// The distributed optimizer on GPUs: AdamW state and updates sharded by parameter (owners
// broadcast the weights), Muon's Newton-Schulz batches split over the ranks (results
// all-gathered, every rank applies them). Losses must be the one-GPU run's, eager and graph;
// a checkpoint it saves must hold every rank's state: resuming from step 2 must reproduce steps
// 3 and 4 (a rank's AdamW moments lost in the save would change them).
TEST(DataParallelGpu, DistributedOptimizerMatchesOneGpuAndResumes) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string dist =
        "--set optimizer=muon --set muon_split_qkv_per_head=true "
        "--set use_distributed_optimizer=true ";
    compare_with_one_gpu("distopt-eager", dist);
    compare_with_one_gpu(
        "distopt-graph",
        dist + "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1");

    const std::string full = test::temp_dir("distopt-full"),
                      resumed = test::temp_dir("distopt-res");
    ASSERT_EQ(launch(2, full, dist + "--set train_iters=4 --set save_interval=2", true), 0)
        << tail_of(full + "/rank0.log") << tail_of(full + "/rank1.log");
    ASSERT_TRUE(fs::exists(full + "/checkpoints/iter_0000002"));
    ASSERT_EQ(launch(2, resumed,
                     dist + "--set train_iters=4 --set save_interval=0 --resume " + full +
                         "/checkpoints/iter_0000002"),
              0)
        << tail_of(resumed + "/rank0.log") << tail_of(resumed + "/rank1.log");
    expect_resumed_steps("dp2 distopt resume", read_metrics(full), read_metrics(resumed));
}

// Expert parallelism on GPUs: each GPU computes half of the experts for both GPUs' rows (rows
// pulled from the peer's memory over NVLink by the exchange kernels, counts read on the device),
// results and input gradients pulled back. Losses, gradient norms and expert loads must be the
// one-GPU run's, eager and in the captured full-iteration graph (the exchange lives in it).
TEST(DataParallelGpu, ExpertParallelTwoGpusMatchOneGpuEagerAndGraph) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string ep = "--set expert_model_parallel_size=2";
    compare_with_one_gpu("ep2-eager", "", ep);
    compare_with_one_gpu(
        "ep2-graph", "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1", ep);
    compare_with_one_gpu("ep2-distopt-muon",
                         "--set optimizer=muon --set use_distributed_optimizer=true", ep);
    // Force-balanced routing: the receive buffers planned at tokens x top-k rows (half of the
    // dropless bound here), filled exactly by the rule.
    compare_with_one_gpu("ep2-force", "--set moe_router_force_load_balancing=true", ep);
}

// The NCCL transport of the expert exchange (what runs when the group spans nodes), forced on
// one node: fixed-size blocks per pair of ranks through grouped send/recv, packed and unpacked
// on the device. The same one-GPU losses, eager and captured, dropless and force-balanced.
TEST(DataParallelGpu, ExpertParallelOverNcclMatchesOneGpuEagerAndGraph) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string ep = "--set expert_model_parallel_size=2 --set moe_expert_exchange=nccl";
    compare_with_one_gpu("ep2-nccl-eager", "", ep);
    compare_with_one_gpu("ep2-nccl-graph",
                         "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1",
                         ep);
    compare_with_one_gpu("ep2-nccl-force", "--set moe_router_force_load_balancing=true", ep);
}

// The paged MoE stash under expert parallelism: each GPU keeps the rows its experts received
// (input, gate and up) in pages; with a pool too small for the step every rank's optimizer step
// is vetoed together and both redo it eagerly (the redo exchanges rows again), so the losses stay
// the one-GPU run's and the redo is counted.
TEST(DataParallelGpu, ExpertParallelPagedStashMatchesOneGpuAndRedoesTogether) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string ep = "--set expert_model_parallel_size=2";
    compare_with_one_gpu("ep2-stash", "--set moe_paged_stash=true", ep);
    compare_with_one_gpu("ep2-stash-graph",
                         "--set moe_paged_stash=true --set cuda_graph_impl=full_iteration --set "
                         "cuda_graph_warmup_steps=1",
                         ep);
    const auto two = compare_with_one_gpu(
        "ep2-stash-overflow",
        "--set moe_paged_stash=true --set moe_paged_stash_buffer_size_factor_cuda=0.2", ep);
    ASSERT_FALSE(two.empty());
    EXPECT_GT(two.back().value("moe_stash_redos", 0), 0) << two.back().dump();
}

// The expert-parallel receive budget on two GPUs over NCCL: with a factor that every step exceeds
// (0.5: blocks of half the balanced rows) both ranks veto their update together and redo the step
// in token chunks, eagerly and from the captured graph; with a factor no step exceeds (1.5) the
// graph replays. The losses stay the one-GPU run's either way, and the redos are counted.
TEST(DataParallelGpu, ExpertParallelReceiveBudgetMatchesOneGpuAndRedoesTogether) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string ep = "--set expert_model_parallel_size=2 --set moe_expert_exchange=nccl";
    const auto redone =
        compare_with_one_gpu("ep2-budget-0.5", "--set moe_expert_rank_capacity_factor=0.5", ep);
    ASSERT_FALSE(redone.empty());
    EXPECT_EQ(redone.back().value("moe_budget_redos", 0), 4) << redone.back().dump();
    const auto graph =
        compare_with_one_gpu("ep2-budget-0.5-graph",
                             "--set moe_expert_rank_capacity_factor=0.5 --set "
                             "cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1",
                             ep);
    ASSERT_FALSE(graph.empty());
    EXPECT_EQ(graph.back().value("moe_budget_redos", 0), 4) << graph.back().dump();
    const auto held =
        compare_with_one_gpu("ep2-budget-1.5-graph",
                             "--set moe_expert_rank_capacity_factor=1.5 --set "
                             "cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1",
                             ep);
    ASSERT_FALSE(held.empty());
    EXPECT_EQ(held.back().value("moe_budget_redos", 0), 0) << held.back().dump();
    EXPECT_TRUE(held.back().value("graph", false));
}

// Optimizer offload under the distributed optimizer on two GPUs: each rank's masters and state
// in its pinned host memory; the losses are the one-GPU run's, eager and in the graph.
TEST(DataParallelGpu, OptimizerOffloadMatchesOneGpuEagerAndGraph) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string off =
        "--set optimizer=muon --set use_distributed_optimizer=true "
        "--set optimizer_cpu_offload=true ";
    compare_with_one_gpu("offload-eager", off);
    compare_with_one_gpu(
        "offload-graph",
        off + "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1");
}

// Sharded experts on GPUs: an EP2 run (each GPU holds, trains and saves half of the experts)
// checkpoints at step 2 as two shards and an index; one GPU resuming from it (reading both
// shards: every expert's weights and Muon momentum) reproduces steps 3 and 4.
TEST(DataParallelGpu, ExpertParallelCheckpointResumesOnOneGpu) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string args = "--set optimizer=muon --set train_iters=4 ";
    const std::string full = test::temp_dir("ep2-ckpt-full"), one = test::temp_dir("ep2-ckpt-one");
    ASSERT_EQ(
        launch(2, full, args + "--set save_interval=2 --set expert_model_parallel_size=2", true), 0)
        << tail_of(full + "/rank0.log") << tail_of(full + "/rank1.log");
    const std::string ckpt = full + "/checkpoints/iter_0000002";
    ASSERT_TRUE(fs::exists(ckpt + "/model-00001-of-00002.safetensors"));
    ASSERT_TRUE(fs::exists(ckpt + "/model-00002-of-00002.safetensors"));
    ASSERT_TRUE(fs::exists(ckpt + "/model.safetensors.index.json"));
    // The checkpoint's recipe asks for EP 2: one GPU overrides it.
    ASSERT_EQ(
        launch(1, one,
               args + "--set save_interval=0 --set expert_model_parallel_size=1 --resume " + ckpt),
        0)
        << tail_of(one + "/rank0.log");
    expect_resumed_steps("ep2 checkpoint -> 1 GPU", read_metrics(full), read_metrics(one));
}

// Context parallelism on GPUs: each GPU computes its two chunks of every document of every
// micro-batch (DP 1 x CP 2); the latent keys K' and indexer keys k_I of all rows are gathered
// over NCCL (the top-k runs over micro-batch key rows, 64 of up to 256), the key gradients summed
// back; the e2e_tv targets read the other GPU's rows. Losses, gradient norms and expert loads
// must be the one-GPU run's, eager and in the captured graph. Step 1's tolerances (losses 1e-5,
// gradient norm 1e-4, 0.1% of the routed rows at another expert): the GEMMs run over about half
// the rows, where cuBLASLt may pick other kernels whose bf16 outputs round differently (seen:
// grad_norm 5.2e-5 apart, 2 of 4096 routed rows moved), and the key gradients are summed in
// another order.
TEST(DataParallelGpu, ContextParallelTwoGpusMatchOneGpuEagerAndGraph) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string cp = "--set context_parallel_size=2";
    compare_with_one_gpu("cp2-eager", "", cp, 1e-5, 1e-3);
    compare_with_one_gpu("cp2-graph",
                         "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1", cp,
                         1e-5, 1e-3);
    compare_with_one_gpu("cp2-e2e-tv", "--set mtp_loss_type=e2e_tv --set mtp_detach_heads=true", cp,
                         1e-5, 1e-3);
}

// Dynamic CP on GPUs: the step's documents (pieces of up to 256 tokens) scheduled at 160 tokens
// per rank: longer pieces run in groups of both GPUs (CP 2 over the size-2 communicator), shorter
// ones in groups of one GPU side by side (or grown into an idle neighbour). The documents are the
// one-GPU run's, regrouped: LM, MTP and indexer losses, gradient norms and loads must match it
// (per-token loss on both sides: the indexer's KL over the global batch's tokens, so the grouping
// does not change it), eagerly and with the step's graphs (one per micro-batch kind, replayed
// for later micro-batches, between the graphs of the step's start and end).
TEST(DataParallelGpu, DynamicContextParallelTwoGpusMatchOneGpuEagerAndGraph) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string both = "--set calculate_per_token_loss=true ";
    const std::string dyn =
        "--set context_parallel_size=2 --set dynamic_context_parallel=true "
        "--set sequence_packing_scheduler=default_dynamic_cp --set max_seqlen_per_dp_cp_rank=160";
    compare_with_one_gpu("dcp-eager", both, dyn, 1e-5, 1e-3);
    const auto m = compare_with_one_gpu(
        "dcp-graph", both + "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1",
        dyn, 1e-5, 1e-3);
    // Groups of two GPUs ran (and the replays).
    ASSERT_FALSE(m.empty());
    EXPECT_TRUE(m.back().value("graph", false)) << "the last step replayed its graphs";
    int64_t sizes[2] = {0, 0};
    for (const auto& step : m)
        for (size_t k = 0; k < step["dynamic_cp_groups"].size() && k < 2; ++k)
            sizes[k] += int64_t(step["dynamic_cp_groups"][k]);
    std::cout << "[dynamic cp] groups of 1 GPU: " << sizes[0] << ", of 2 GPUs: " << sizes[1]
              << std::endl;
    EXPECT_GT(sizes[1], 0) << "no group of 2 GPUs ran";
}

// Pipeline parallelism on GPUs: stage 0 holds the embedding and the first layers, stage 1 the
// rest, the head, the losses and the MTP layer (with its copy of the embedding); 1F1B over the
// step's micro-batches, the stage boundary's rows and gradients through NCCL send/recv, stage 0
// recomputing its forward before each backward. Losses, gradient norms and loads must be the
// one-GPU run's, eagerly and in the captured full-iteration graph, with an IndexShare layer inside
// the second stage, and with two interleaved chunks per GPU; a PP 2 checkpoint resumes on one
// GPU. Offset 2 makes the tiny model's layers
// full, so each stage starts on one (Megatron's rule).
TEST(DataParallelGpu, PipelineParallelTwoGpusMatchOneGpuEagerAndGraphAndResumes) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string pp = "--set pipeline_model_parallel_size=2";
    const std::string full_layers = "--set dsa_indexer_skip_topk_offset=2 ";
    compare_with_one_gpu("pp2-eager", full_layers, pp);
    compare_with_one_gpu(
        "pp2-graph",
        full_layers + "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1", pp);
    const std::string four =
        "--set num_layers=4 --set moe_layer_freq=[0,1,1,1] "
        "--set optimizer=muon " +
        full_layers;
    compare_with_one_gpu("pp2-indexshare", four, pp + " --set decoder_first_pipeline_num_layers=1");
    // Interleaved: two chunks of a layer each per GPU (GPU 0 layers 0 and 2, GPU 1 layers 1 and
    // 3), every layer computing its indexer; the forward messages of chunk 0's last stage go
    // round the ring to GPU 0's second chunk.
    const std::string vpp = pp + " --set num_virtual_stages_per_pipeline_rank=2";
    const std::string four_full =
        "--set num_layers=4 --set moe_layer_freq=[0,1,1,1] --set dsa_indexer_topk_freq=1 ";
    compare_with_one_gpu("pp2v2-eager", four_full, vpp);
    compare_with_one_gpu(
        "pp2v2-graph",
        four_full + "--set cuda_graph_impl=full_iteration --set cuda_graph_warmup_steps=1", vpp);

    const std::string full = test::temp_dir("pp2-ckpt-full"), one = test::temp_dir("pp2-ckpt-one");
    ASSERT_EQ(
        launch(2, full, "--set train_iters=4 --set save_interval=2 " + full_layers + pp, true), 0)
        << tail_of(full + "/rank0.log") << tail_of(full + "/rank1.log");
    const std::string ckpt = full + "/checkpoints/iter_0000002";
    ASSERT_TRUE(fs::exists(ckpt + "/model.safetensors.index.json"));
    ASSERT_EQ(launch(1, one,
                     "--set train_iters=4 --set save_interval=0 " + full_layers +
                         "--set pipeline_model_parallel_size=1 --resume " + ckpt),
              0)
        << tail_of(one + "/rank0.log");
    expect_resumed_steps("pp2 checkpoint -> 1 GPU", read_metrics(full), read_metrics(one));
}

// The exchange alone (sparsetron bench-exchange, two processes), both transports: a dispatch and
// a combine of known rows checked bit for bit inside (a wrong row exits non-zero naming it and
// the transport), uneven sizes against the 16-byte copies (dim 136 = 17 x 8), then timed against
// NCCL's all-to-all.
TEST(DataParallelGpu, ExpertExchangeDeliversEveryRowAndIsTimed) {
    REQUIRE_GPU();
    if (cuda_device_count() < 2)
        GTEST_SKIP() << "needs 2 GPUs (nvidia-h200-x2): this machine has " << cuda_device_count();
    const std::string out = test::temp_dir("bench-exchange");
    const int port = 23000 + int(::getpid() % 20000);
    std::string cmd = "cd " + out + " && ";
    for (int r = 0; r < 2; ++r)
        cmd += "RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(r) +
               " MASTER_PORT=" + std::to_string(port) + " NCCL_NVLS_ENABLE=0 " + cli_path() +
               " bench-exchange --rows 2400 --dim 136 --experts 8 --iters 3 --warmup 1 > " + out +
               "/rank" + std::to_string(r) + ".log 2>&1 & ";
    cmd += "fail=0; for j in $(jobs -p); do wait $j || fail=1; done; exit $fail";
    ASSERT_EQ(std::system(("bash -c '" + cmd + "'").c_str()), 0)
        << tail_of(out + "/rank0.log") << tail_of(out + "/rank1.log");
    const std::string log = tail_of(out + "/rank0.log");
    std::cout << log;
    EXPECT_NE(log.find("delivered every row bit for bit (verified, both transports)"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("exchange, NVLink (CUDA IPC)"), std::string::npos) << log;
    EXPECT_NE(log.find("exchange, NCCL blocks"), std::string::npos) << log;
    EXPECT_NE(log.find("NCCL send/recv all-to-all"), std::string::npos) << log;
}
