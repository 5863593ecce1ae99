// Audited FLOPs (SPEC §8) against the seed's published figure.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/plan_growth.h"
#if SPARSETRON_WITH_CUDA
#include "sparsetron/model/cuda/cuda_common.h"
#endif
#include "sparsetron/model/moe_stash_bound.h"
#include "sparsetron/parallel/layout/layout.h"
#include "sparsetron/perf/flops.h"
#include "sparsetron/runtime/cuda_plan.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

using namespace sparsetron;

TEST(Flops, SeedSixteenGpuProxyAtThd4kMatchesThePublishedFigure) {
    // The seed's formal workload: the 16-GPU recipe at THD4K, GBS 64 x one 4096-token document.
    Recipe r = load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-16gpu.yaml", {});
    const FlopCount f = audited_flops(r.model, std::vector<int64_t>(64, 4096));
    const double seed = 36.4994e15;
    std::cout << "audited " << f.total / 1e15 << " PFLOP/step (seed 36.4994)\n";
    EXPECT_NEAR(f.total, seed, 1e-3 * seed);
    double sum = 0;
    for (auto& [name, v] : f.terms) sum += v;
    EXPECT_DOUBLE_EQ(sum, f.total);
    EXPECT_EQ(f.tokens, 64 * 4096);
}

TEST(Flops, AttentionFollowsTheTopkAndOnlyRealTokensCount) {
    Recipe r =
        load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml", {});
    const FlopCount a = audited_flops(r.model, {4096});
    r.model.dsa_indexer_topk = 1024;
    const FlopCount b = audited_flops(r.model, {4096});
    EXPECT_LT(b.total, a.total);
    // Two documents of 2048 have fewer causal pairs than one of 4096 (same tokens).
    const FlopCount c = audited_flops(r.model, {2048, 2048});
    EXPECT_LT(c.total, a.total);
    EXPECT_EQ(c.tokens, 4096);
}

namespace {
std::pair<int, std::string> cli(const std::string& args) {
    auto r = sparsetron::test::run_cli(args);
    return {r.code, r.output};
}
}  // namespace

TEST(Flops, CliPrintsTheSeedWorkloadsCountAndBreakdown) {
    const std::string recipe =
        std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-16gpu-thd4k.yaml";
    auto [rc, out] = cli("flops --recipe " + recipe + " --json");
    ASSERT_EQ(rc, 0) << out;
    const auto j = nlohmann::json::parse(out);
    const double seed = 36.4994e15;
    EXPECT_NEAR(j.at("total_flops").get<double>(), seed, 1e-3 * seed);
    EXPECT_EQ(j.at("tokens").get<int64_t>(), 64 * 4096);
    EXPECT_NE(j.at("convention").get<std::string>().find("SPEC"), std::string::npos);
    double sum = 0;
    for (auto& [k, v] : j.at("terms").items()) sum += v.get<double>();
    EXPECT_NEAR(sum, j.at("total_flops").get<double>(), 1.0);
    EXPECT_GT(j.at("terms").at("output_heads").get<double>(), 0);
    auto [rc2, table] = cli("flops --recipe " + recipe + " --convention megatron");
    EXPECT_EQ(rc2, 0);
    EXPECT_NE(table.find("36.5087 PFLOP/step"), std::string::npos) << table;
    EXPECT_NE(table.find("Megatron stock formula"), std::string::npos) << table;
    // Padding never counts: two documents of 100 tokens in a 4096-slot micro-batch count 200.
    auto [rc3, small] = cli("flops --recipe " + recipe + " --doc-lengths 100,100 --json");
    EXPECT_EQ(nlohmann::json::parse(small).at("tokens").get<int64_t>(), 200);
    // --json FILE (every subcommand's meaning): the text on stdout, one JSON line appended per run.
    const std::string file = sparsetron::test::temp_dir("flops-json") + "/flops.jsonl";
    std::remove(file.c_str());
    for (int i = 0; i < 2; ++i) {
        auto [rcf, text] = cli("flops --recipe " + recipe + " --json " + file);
        EXPECT_EQ(rcf, 0);
        EXPECT_NE(text.find("FLOPs per step of"), std::string::npos) << text;
    }
    std::ifstream lines(file);
    std::string line;
    int n = 0;
    for (; std::getline(lines, line); ++n)
        EXPECT_EQ(nlohmann::json::parse(line).at("tokens").get<int64_t>(), 64 * 4096);
    EXPECT_EQ(n, 2);
    auto [rc4, bad] = cli("flops --recipe " + recipe + " --doc-lengths 100,x");
    EXPECT_EQ(rc4, 1);
    EXPECT_NE(bad.find("--doc-lengths: 'x' is not a positive integer"), std::string::npos) << bad;
}

TEST(Plan, CudaPlanIsPrintedWithoutAGpu) {
    // The device plan is built from the recipe alone (nothing touches a GPU), so CI can check it.
    const std::string recipe = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/tiny.yaml";
    auto r = sparsetron::test::run_cli("plan --recipe " + recipe + " --device cuda");
#if SPARSETRON_WITH_CUDA
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("device memory plan"), std::string::npos) << r.output;
    for (const char* cls : {"parameters", "gradients", "optimizer state", "activations", "total"})
        EXPECT_NE(r.output.find(cls), std::string::npos) << cls;
    // bf16 activations: the first layer's normed input is planned in bf16 on the device.
    EXPECT_NE(r.output.find("bf16"), std::string::npos) << r.output;
    // fp8_recipe: blockwise adds one parameter buffer per FP8 linear (e4m3 W and W^T with their
    // scales in one block) and the operand scratch. The tiny recipe's FP8 linears: per MLA (2
    // layers + the MTP layer) q_a, q_b, kv_a, o_proj; the dense MLP's three; the MoE layers'
    // shared experts (layer 1 and the MTP layer) three each; eh_proj: 12 + 3 + 6 + 1 = 22. The
    // routed experts add four per expert kind of each MoE layer (all experts' W, W^T and scales
    // packed): gate, up and down of layer 1 and the MTP layer, 6. Every weight read only through
    // FP8 drops its bf16 copy: the 22 linears and the routed experts' 3 kinds x 4 experts x 2
    // layers = 24.
    auto f = sparsetron::test::run_cli("plan --recipe " + recipe +
                                       " --device cuda --set fp8_recipe=blockwise");
    EXPECT_EQ(f.code, 0) << f.output;
    const auto parameter_buffers = [](const std::string& out) {
        const size_t at = out.find("parameters");
        const size_t open = out.find('(', at);
        return at == std::string::npos ? -1 : std::stol(out.substr(open + 1));
    };
    EXPECT_EQ(parameter_buffers(f.output), parameter_buffers(r.output) + 22 + 4 * 6 - (22 + 24))
        << f.output;
    // FP8 GEMMs contract over multiples of 16: a weight dimension or a micro-batch that is not
    // one stops with the name of what to change.
    auto odd = sparsetron::test::run_cli("plan --recipe " + recipe +
                                         " --device cuda --set fp8_recipe=blockwise"
                                         " --set ffn_hidden_size=344");
    EXPECT_EQ(odd.code, 1) << odd.output;
    EXPECT_NE(odd.output.find("multiples of 16 on both sides"), std::string::npos) << odd.output;
    auto rows = sparsetron::test::run_cli("plan --recipe " + recipe +
                                          " --device cuda --set fp8_recipe=blockwise"
                                          " --set seq_length=200");
    EXPECT_EQ(rows.code, 1) << rows.output;
    EXPECT_NE(rows.output.find("micro-batch rows in multiples of 16"), std::string::npos)
        << rows.output;
    // dsa_saved_probs_max_mib: one bf16 [4 heads x 256 tokens, 256 keys] probability buffer per
    // masked attention application (2 layers + 2 MTP depths, one chunk each); none by default
    // or when a layer's exceed the bound (512 KiB > 0 MiB). The masked form runs where the keys
    // are at most twice the top-k: top-k 128 for the tiny recipe's 256 tokens.
    const auto activation_buffers = [](const std::string& out) {
        const size_t at = out.find("\nactivations");
        const size_t open = out.find('(', at);
        return at == std::string::npos ? -1 : std::stol(out.substr(open + 1));
    };
    const std::string masked = " --device cuda --set dsa_indexer_topk=128";
    auto none = sparsetron::test::run_cli("plan --recipe " + recipe + masked);
    auto kept = sparsetron::test::run_cli("plan --recipe " + recipe + masked +
                                          " --set dsa_saved_probs_max_mib=1");
    EXPECT_EQ(kept.code, 0) << kept.output;
    EXPECT_EQ(activation_buffers(kept.output), activation_buffers(none.output) + 4) << kept.output;
    for (const char* name : {"layers.0.attn_probs", "layers.1.attn_probs", "mtp.depth1.attn_probs",
                             "mtp.depth2.attn_probs"})
        EXPECT_NE(kept.output.find(name), std::string::npos) << name;
    EXPECT_EQ(none.output.find("attn_probs"), std::string::npos) << none.output;
#else
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("built without CUDA"), std::string::npos) << r.output;
#endif
}

TEST(Plan, LengthsShowEachClassAtEveryLength) {
    const std::string recipe = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/tiny.yaml";
    auto r = sparsetron::test::run_cli("plan --recipe " + recipe + " --lengths 256,1024,4096");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("host memory plan"), std::string::npos) << r.output;
    const size_t header = r.output.find("tokens per micro-batch");
    ASSERT_NE(header, std::string::npos) << r.output;
    const std::string row = r.output.substr(header, r.output.find('\n', header) - header);
    for (const char* n : {"256", "1024", "4096"}) EXPECT_NE(row.find(n), std::string::npos) << row;
    for (const char* cls : {"parameters", "activations", "workspace", "total"})
        EXPECT_NE(r.output.find(cls), std::string::npos) << cls;
    // Either verdict is printed: the buffers that outgrow the tokens, or that none does.
    EXPECT_TRUE(r.output.find("grow faster than the tokens") != std::string::npos ||
                r.output.find("every buffer grows at most linearly") != std::string::npos)
        << r.output;
    auto bad = sparsetron::test::run_cli("plan --recipe " + recipe + " --lengths 1024,x");
    EXPECT_EQ(bad.code, 1) << bad.output;
    EXPECT_NE(bad.output.find("--lengths: 'x' is not a positive token count"), std::string::npos)
        << bad.output;
    auto down = sparsetron::test::run_cli("plan --recipe " + recipe + " --lengths 1024,256");
    EXPECT_EQ(down.code, 1) << down.output;
    EXPECT_NE(down.output.find("strictly ascending"), std::string::npos) << down.output;
}

#if SPARSETRON_WITH_CUDA
namespace {
// The device plan of the H200 proxy recipe with `sets` (built from the recipe alone: no GPU).
MemoryPlan proxy_device_plan(const std::vector<std::string>& sets) {
    const Recipe r =
        load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml", sets);
    auto tp = make_training_plan(r, Device::CUDA);
    return cuda_memory_plan(r, *tp->params, tp->max_documents, tp->chunk_rows);
}
bool plan_has(const MemoryPlan& plan, const std::string& name) {
    for (const PlanEntry& e : plan.entries())
        if (e.name == name) return true;
    return false;
}
}  // namespace
#endif

// The sparse attention's form follows the length (planned from the recipe; no GPU needed): the
// masked dense GEMMs in the expanded form while the keys are at most twice the top-k (the
// proxy's 4096 tokens with top-2048), the flash kernels over the selected keys in the absorbed
// form past that (8192 and 16384 tokens, where the masked form did 2x and 4x the dense work).
TEST(Plan, SparseAttentionFormFollowsTheLength) {
#if SPARSETRON_WITH_CUDA
    for (int64_t tokens : {4096, 8192, 16384}) {
        const MemoryPlan plan = proxy_device_plan({"mtp_num_layers=0", cat("seq_length=", tokens)});
        const auto has = [&](const std::string& name) { return plan_has(plan, name); };
        const bool masked = tokens <= 2 * 2048;
        EXPECT_EQ(has("attn.sparse_mqa_masked"), masked) << tokens;
        EXPECT_EQ(has("layers.0.q_absorbed"), !masked) << tokens;
    }
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// Past the attention's form switch (32K and up), the proxy's device plan grows linearly in tokens:
// neither the backbone (indexer loss off) nor the full step (MTP x7 with e2e TV, the indexer loss)
// has a buffer that grows faster or one of tokens x vocabulary (the indexer's scores, top-k and
// loss go in blocks of query rows).
TEST(Plan, LongContextBuffersGrowLinearlyPastTheFormSwitch) {
#if SPARSETRON_WITH_CUDA
    const std::string recipe =
        std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml";
    auto growth = [&](const std::vector<std::string>& sets) {
        const std::vector<int64_t> lengths = {32768, 65536, 131072};
        std::vector<MemoryPlan> plans;
        std::vector<const MemoryPlan*> ptrs;
        for (int64_t n : lengths) {
            std::vector<std::string> at = sets;
            at.push_back(cat("seq_length=", n));
            plans.push_back(proxy_device_plan(at));
        }
        for (const MemoryPlan& p : plans) ptrs.push_back(&p);
        PlanGrowth g = plan_growth(lengths, ptrs, load_recipe(recipe, {}).model.vocab_size);
        std::vector<std::string> faster, by_vocab;
        for (const BufferGrowth* b : g.faster_than_linear()) faster.push_back(b->name);
        for (const BufferGrowth* b : g.tokens_by_vocab()) by_vocab.push_back(b->name);
        std::sort(faster.begin(), faster.end());
        return std::make_pair(faster, by_vocab);
    };
    const auto backbone = growth({"mtp_num_layers=0", "dsa_indexer_loss_coeff=0"});
    EXPECT_TRUE(backbone.first.empty()) << backbone.first.front();
    EXPECT_TRUE(backbone.second.empty()) << backbone.second.front();
    const auto step = growth({});
    EXPECT_TRUE(step.first.empty()) << step.first.front();
    EXPECT_TRUE(step.second.empty()) << step.second.front();
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// The proxy backbone at 131,072 tokens with every recompute module plans within one H200 (139.8
// GiB, of which the CUDA context and cuBLASLt's workspace take about a GiB): the workspace phases
// share one area, the recomputed attention, dense MLP, shared expert and router run in blocks, and
// the MoE's routed rows are the largest phase.
TEST(Plan, BackboneAt128KFitsOneH200WithEveryRecomputeModule) {
#if SPARSETRON_WITH_CUDA
    const MemoryPlan plan = proxy_device_plan(
        {"mtp_num_layers=0", "dsa_indexer_loss_coeff=0", "seq_length=131072",
         "recompute_granularity=selective",
         "recompute_modules=core_attn mla_up_proj layernorm moe_act mlp shared_experts"});
    const double GiB = double(1 << 30);
    EXPECT_LE(double(plan.total_bytes()) / GiB, 135.0) << plan.format(12);
    const auto& phases = plan.phase_bytes(MemClass::Workspace);
    ASSERT_EQ(phases.size(), 3u);
    EXPECT_GT(phases.at("moe"), phases.at("attention"));
    EXPECT_GT(phases.at("moe"), phases.at("mlp"));
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// A device plan larger than the GPU's free memory stops before cudaMalloc with what would fit: the
// proxy backbone at 32K fits a GPU between its all-recompute plan and its keep plan with every
// recompute module, not one below the all-recompute plan; a recipe that already recomputes
// everything is pointed at the length and CP instead.
TEST(Plan, AShortfallNamesTheRecomputeThatWouldFit) {
#if SPARSETRON_WITH_CUDA
    const std::string recipe =
        std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml";
    const Recipe r =
        load_recipe(recipe, {"mtp_num_layers=0", "dsa_indexer_loss_coeff=0", "seq_length=32768"});
    auto tp = make_training_plan(r, Device::CUDA);
    const auto& store = *tp->params;
    const size_t planned =
        cuda_memory_plan(r, store, tp->max_documents, tp->chunk_rows).total_bytes();
    Recipe all = r;
    all.model.recompute_granularity = "selective";
    all.model.recompute_modules = recompute_module_names();
    const size_t recomputing =
        cuda_memory_plan(all, store, tp->max_documents, tp->chunk_rows).total_bytes();
    const size_t GiB = size_t(1) << 30;
    ASSERT_LT(recomputing + 2 * GiB, planned);
    EXPECT_EQ(cuda_plan_shortfall(r, store, tp->max_documents, tp->chunk_rows, planned, planned),
              "");
    const size_t between = (planned + recomputing) / 2, below = recomputing - GiB;
    std::string msg =
        cuda_plan_shortfall(r, store, tp->max_documents, tp->chunk_rows, planned, between);
    EXPECT_NE(msg.find(cat("the device memory plan needs ", format_bytes(double(planned)),
                           " but the GPU has ", format_bytes(double(between)), " free")),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(cat("moe_act, mlp, shared_experts] it plans ",
                           format_bytes(double(recomputing)), " and fits")),
              std::string::npos)
        << msg;
    msg = cuda_plan_shortfall(r, store, tp->max_documents, tp->chunk_rows, planned, below);
    EXPECT_NE(msg.find(cat("it plans ", format_bytes(double(recomputing)), ", still too much")),
              std::string::npos)
        << msg;
    msg = cuda_plan_shortfall(all, store, tp->max_documents, tp->chunk_rows, planned, below);
    EXPECT_EQ(msg.find("recompute_modules"), std::string::npos) << msg;
    EXPECT_NE(msg.find("shorter micro-batches (seq_length) or more context-parallel ranks"),
              std::string::npos)
        << msg;
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// Selective recompute keeps one shared buffer per recomputed output instead of one per layer: the
// proxy's 4 layers at 32K tokens (the absorbed attention's Q' and o' are 2.25 and 2 GiB per layer)
// plan 20 GiB less with four modules than the keep plan, which itself fits the 125 GiB the
// long-context work set for one H200. The dense MLP's (mlp) and the shared expert's
// (shared_experts) rows likewise.
TEST(Plan, SelectiveRecomputeSharesTheRecomputedBuffers) {
#if SPARSETRON_WITH_CUDA
    auto plan_of = [&](std::vector<std::string> sets) {
        sets.insert(sets.end(),
                    {"mtp_num_layers=0", "dsa_indexer_loss_coeff=0", "seq_length=32768"});
        return proxy_device_plan(sets);
    };
    const MemoryPlan keep = plan_of({});
    const MemoryPlan rec = plan_of({"recompute_granularity=selective",
                                    "recompute_modules=core_attn mla_up_proj layernorm moe_act"});
    const auto& has = plan_has;
    for (const char* name :
         {"layers.0.o_latent", "layers.3.attn_out", "layers.1.q_absorbed", "layers.2.q",
          "layers.0.attn_norm_out", "layers.3.mlp_norm_out", "layers.2.moe.expert_act"}) {
        EXPECT_TRUE(has(keep, name)) << name;
        EXPECT_FALSE(has(rec, name)) << name;
    }
    // 32K rows run the attention in query blocks of recompute_block_rows (16384): its
    // recomputed buffers hold one block; with blocks as long as the micro-batch, all of it.
    for (const char* name : {"attn.query_block.o_latent", "attn.query_block.q_absorbed",
                             "layer.recomputed.norm_out", "moe.recomputed.expert_act"})
        EXPECT_TRUE(has(rec, name)) << name;
    for (const PlanEntry& e : rec.entries())
        if (e.name.rfind("attn.query_block.", 0) == 0 && e.name != "attn.query_block.lse") {
            EXPECT_EQ(e.shape[0], 16384) << e.name;
        }
    const MemoryPlan whole = plan_of({"recompute_granularity=selective",
                                      "recompute_modules=core_attn mla_up_proj layernorm moe_act",
                                      "recompute_block_rows=32768"});
    EXPECT_TRUE(has(whole, "attn.recomputed.q_absorbed"));
    EXPECT_FALSE(has(whole, "attn.query_block.q_absorbed"));
    EXPECT_GT(whole.total_bytes(), rec.total_bytes());
    const double GiB = double(1 << 30);
    EXPECT_LE(double(keep.total_bytes()) / GiB, 125.0);
    EXPECT_LE(double(rec.total_bytes()) / GiB, double(keep.total_bytes()) / GiB - 20.0);
    // Only core_attn (Megatron's default module): the attention outputs go, the rest stay.
    const MemoryPlan core = plan_of({"recompute_granularity=selective"});
    EXPECT_FALSE(has(core, "layers.0.o_latent"));
    EXPECT_TRUE(has(core, "layers.0.q_absorbed"));
    EXPECT_LT(core.total_bytes(), keep.total_bytes());
    const MemoryPlan mlp =
        plan_of({"recompute_granularity=selective", "recompute_modules=mlp shared_experts"});
    for (const char* name : {"layers.0.mlp_gate", "layers.1.mlp_up", "layers.1.mlp_act",
                             "layers.2.moe.shared_gate", "layers.3.moe.shared_act"}) {
        EXPECT_TRUE(has(keep, name)) << name;
        EXPECT_FALSE(has(mlp, name)) << name;
    }
    for (const char* name : {"mlp.recomputed.gate", "mlp.recomputed.up", "mlp.recomputed.act",
                             "moe.shared.recomputed.gate", "moe.shared.recomputed.act"})
        EXPECT_TRUE(has(mlp, name)) << name;
    EXPECT_TRUE(has(mlp, "layers.0.q_absorbed"));
    // Two dense layers' three [tokens, 12288] rows each and two MoE layers' three [tokens, 2048]
    // shared-expert rows go; the one shared set of each lies in its module's workspace phase,
    // which costs at most its own size (nothing where another phase is larger).
    const double saved = double(keep.total_bytes()) - double(mlp.total_bytes());
    const double rows = 32768.0 * 2 * 3;
    EXPECT_GE(saved, rows * (12288 + 2048) - 1e6) << saved / GiB;
    EXPECT_LE(saved, 2 * rows * (12288 + 2048) + 1e6) << saved / GiB;
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// What the backward rebuilds exactly from what it keeps is planned once, not per application: the
// routed experts' gathered input rows and the router's fp32 input (from the layer's input), the MTP
// depths' embedding rows and eh_proj input (from the token ids and the previous depth's output; the
// norms write straight into it), the MTP head-norm output (made per depth, or per chunk of rows for
// e2e_tv, where the loss reads it). The MoE's routed rows (gathered input, expert outputs, their
// gradients) take turns in one buffer, the activation's and the gate's gradients share one, and
// the losses' rows share regions with the absorbed attention backward's gradients, which take
// turns in pairs.
TEST(Plan, RowsTheBackwardRebuildsArePlannedOnce) {
#if SPARSETRON_WITH_CUDA
    const MemoryPlan p = proxy_device_plan({"seq_length=8192"});
    for (const char* per_application :
         {"layers.2.moe.x_permuted", "layers.3.moe.router_input_f32", "mtp.depth1.embedding",
          "mtp.depth7.moe.x_permuted", "mtp.depth1.enorm_out", "mtp.depth2.hnorm_out",
          "mtp.depth1.concat", "mtp.depth3.head_norm_out", "grad.moe.x_permuted", "grad.moe.gate",
          "moe.work.x_permuted", "grad.attn.o", "grad.attn.q", "head.dlogits",
          "mtp.tv.draft_probs"})
        EXPECT_FALSE(plan_has(p, per_application)) << per_application;
    for (const char* shared :
         {"moe.rows", "moe.router_input_f32", "mtp.embedding", "mtp.concat", "mtp.head_norm_out",
          "grad.moe.act_then_gate", "grad.attn.q_absorbed | grad.attn.o | head.dlogits",
          "grad.attn.o_latent | grad.attn.q | mtp.tv.draft_probs"})
        EXPECT_TRUE(plan_has(p, shared)) << shared;
    // A region is as large as its largest user: at 8192 tokens the draft rows (7 depths x 512
    // rows x vocab, fp32) against o''s gradient (8192 x 64 heads x 512, bf16).
    for (const PlanEntry& e : p.entries())
        if (e.name == "grad.attn.o_latent | grad.attn.q | mtp.tv.draft_probs") {
            EXPECT_EQ(e.bytes,
                      std::max<size_t>(size_t(7) * 512 * 154880 * 4, size_t(8192) * 64 * 512 * 2));
        }
    // e2e_tv reads the head-norm output one chunk of rows (the recipe's loss_chunk_rows) at a time.
    for (const PlanEntry& e : p.entries())
        if (e.name == "mtp.head_norm_out") {
            EXPECT_EQ(e.shape, (std::vector<int64_t>{512, 6144}));
        }
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// Activation offload plans two device regions, each as large as the largest layer application's
// offloaded buffers, and a pinned host block for every application but the last two: on the
// proxy's full step (4 layers + 7 MTP depths = 11 applications) at 8192 tokens, the offloaded
// buffers leave the device plan, each application's host block is its buffers packed as the
// keep plan lists them, and the device plan shrinks by all applications' buffers less the two
// regions (to the plan's 256-byte alignment per buffer).
TEST(Plan, ActivationOffloadKeepsTwoApplicationsOnTheDevice) {
#if SPARSETRON_WITH_CUDA
    const std::vector<std::string> base = {"seq_length=8192"};
    std::vector<std::string> sets = base;
    sets.insert(sets.end(), {"fine_grained_activation_offloading=true",
                             "offload_modules=attn_norm mlp_norm qkv_linear core_attn attn_proj "
                             "fused_group_mlp"});
    const MemoryPlan keep = proxy_device_plan(base), off = proxy_device_plan(sets);
    const std::vector<std::string> offloaded = {
        "attn_norm_out",   "mlp_norm_out",  "q",
        "q_absorbed",      "o_latent",      "attn_out",
        "moe.expert_gate", "moe.expert_up", "moe.expert_act"};
    std::vector<std::string> apps;
    for (int l = 0; l < 4; ++l) apps.push_back(cat("layers.", l));
    for (int k = 1; k <= 7; ++k) apps.push_back(cat("mtp.depth", k));
    const size_t A = MemoryPlan::kAlignment;
    size_t region = 0, all = 0, removed = 0;
    std::vector<size_t> packed;
    for (const std::string& app : apps) {
        size_t bytes = 0;
        for (const PlanEntry& e : keep.entries())
            for (const std::string& n : offloaded)
                if (e.name == app + "." + n) {
                    bytes = (bytes + A - 1) / A * A + e.bytes;
                    EXPECT_FALSE(plan_has(off, e.name)) << e.name;
                    ++removed;
                }
        EXPECT_GT(bytes, 0u) << app;
        packed.push_back(bytes);
        region = std::max(region, bytes);
        all += bytes;
    }
    EXPECT_EQ(removed, 4 * 6 + 2 * 3 + 7 * 9u) << "attention in every application, routed "
                                                  "MLP rows (gate, up, SwiGLU) in the MoE ones";
    size_t host = 0;
    for (size_t g = 0; g < apps.size(); ++g) {
        const bool on_host = g + 2 < apps.size();
        EXPECT_EQ(plan_has(off, "offload." + apps[g]), on_host) << apps[g];
        for (const PlanEntry& e : off.entries())
            if (e.name == "offload." + apps[g]) {
                EXPECT_EQ(e.cls, MemClass::HostOffload);
                EXPECT_EQ(e.bytes, packed[g]) << apps[g];
            }
        if (on_host) host += packed[g];
    }
    EXPECT_EQ(off.host_offload_bytes(), host);
    EXPECT_EQ(keep.host_offload_bytes(), 0u);
    for (const char* r : {"offload.device_region.0", "offload.device_region.1"})
        for (const PlanEntry& e : off.entries())
            if (e.name == r) {
                EXPECT_EQ(e.bytes, region) << r;
            }
    const double saved = double(keep.total_bytes()) - double(off.total_bytes());
    const double expected = double(all) - 2.0 * double(region);
    EXPECT_NEAR(saved, expected, double(A) * double(removed + 2)) << "saved " << saved;
    const double GiB = double(1 << 30);
    std::cout << "[plan] full proxy step at 8192 tokens: device " << keep.total_bytes() / GiB
              << " -> " << off.total_bytes() / GiB << " GiB with offload, host " << host / GiB
              << " GiB\n";
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// The bench never times an FP8 recipe in bf16: the seed's mxfp8 stops before any GPU work with
// the overlay to use, which then gets past the FP8 check (to the GPU's absence here, or a run).
TEST(Bench, Mxfp8RecipeStopsNamingTheOverlay) {
    const std::string seed = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-16gpu.yaml";
    auto r = sparsetron::test::run_cli("bench --recipe " + seed + " --iters 1");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("fp8_recipe: mxfp8 is not implemented"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("recipes/overlays/h200.yaml"), std::string::npos) << r.output;
}

// The paged stash under expert parallelism (the proxy at EP2, 4096 tokens, planned for rank 0):
// the received input, gate and up rows are working buffers every application shares instead of
// per-application buffers at the receive bound, the pool's rows hold all three (gate + up + the
// hidden-size input) and are sized from the receive bound, and the plan shrinks.
TEST(Plan, PagedStashUnderExpertParallelismKeepsTheReceivedRows) {
#if SPARSETRON_WITH_CUDA
    const std::vector<std::string> ep = {"world_size=2", "global_batch_size=2",
                                         "expert_model_parallel_size=2"};
    std::vector<std::string> stash = ep;
    stash.push_back("moe_paged_stash=true");
    const MemoryPlan kept = proxy_device_plan(ep), paged = proxy_device_plan(stash);
    for (const char* per_application :
         {"layers.2.moe.x_received", "layers.3.moe.expert_gate", "mtp.depth7.moe.expert_up"}) {
        EXPECT_TRUE(plan_has(kept, per_application)) << per_application;
        EXPECT_FALSE(plan_has(paged, per_application)) << per_application;
    }
    EXPECT_TRUE(plan_has(paged, "moe.work.x_received"));
    EXPECT_TRUE(plan_has(paged, "mtp.depth7.moe.stash_pages"));
    Recipe r =
        load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml", stash);
    r.model.expert_parallel_ranks = 2;
    const MoeStashBound b = moe_stash_bound(r.model, 4096);
    EXPECT_EQ(b.max_rows, r.model.moe_ep_received_rows(4096));
    EXPECT_GT(b.max_rows, 4096 * 8);  // more than a rank routes: what its experts may receive
    const int64_t width = 2 * 2048 + 6144;
    bool pool = false;
    for (const PlanEntry& e : paged.entries())
        if (e.name == "moe.paged_stash.pool") {
            pool = true;
            EXPECT_EQ(e.shape, (std::vector<int64_t>{b.pool_pages * b.page_rows, width}));
        }
    EXPECT_TRUE(pool);
    EXPECT_LT(paged.total_bytes(), kept.total_bytes());
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// The distributed optimizer shards memory (planned without a GPU): on the proxy at DP4 every
// fp32 master and optimizer state tensor is planned on exactly one of the four ranks, but for the
// masters a kernel reads (the routers' fp32 GEMM, the buffers), which every rank keeps, and
// AdamW's matrices (the embedding and the output layer), of which each rank keeps a quarter of
// the rows (master and moments); the bf16 copies stay on every rank. Each rank plans at most a
// quarter of the unsharded masters and state beyond what every rank keeps, plus the largest
// whole matrix's master and momentum (the greedy assignment's bound).
TEST(Plan, DistributedOptimizerKeepsEachMasterAndStateOnOneRank) {
#if SPARSETRON_WITH_CUDA
    const std::vector<std::string> dp4 = {"world_size=4", "global_batch_size=4"};
    std::vector<std::string> dist = dp4;
    dist.push_back("use_distributed_optimizer=true");
    const Recipe r =
        load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml", dist);
    auto tp = make_training_plan(r, Device::CUDA);
    const MemoryPlan whole = proxy_device_plan(dp4);
    auto sharded_bytes = [](const MemoryPlan& p) {
        size_t b = p.class_bytes(MemClass::OptimizerState);
        for (const PlanEntry& e : p.entries())
            if (e.cls == MemClass::Parameters && e.dtype == DType::F32) b += e.bytes;
        return b;
    };
    const auto is_split = [](const std::string& name) {
        return name.rfind("model.embed_tokens.weight", 0) == 0 ||
               name.rfind("lm_head.weight", 0) == 0;
    };
    const auto is_read = [](const std::string& name) {
        return name.find(".mlp.gate.weight") != std::string::npos ||
               name.find("e_score_correction_bias") != std::string::npos;
    };
    size_t largest_whole = 0;  // the largest whole matrix's master and momentum
    for (const PlanEntry& e : whole.entries())
        if (e.cls == MemClass::Parameters && e.dtype == DType::F32 && !is_split(e.name))
            largest_whole = std::max(largest_whole, 2 * e.bytes);
    std::map<std::string, int> ranks_with;  // fp32 master or state tensor -> ranks planning it
    std::map<std::string, size_t> bytes_of;
    size_t everywhere = 0;  // fp32 bytes every rank keeps
    for (int rank = 0; rank < 4; ++rank) {
        const MemoryPlan p =
            cuda_memory_plan(r, *tp->params, tp->max_documents, tp->chunk_rows, {}, rank);
        for (const PlanEntry& e : p.entries())
            if (e.cls == MemClass::OptimizerState ||
                (e.cls == MemClass::Parameters && e.dtype == DType::F32)) {
                ++ranks_with[e.name];
                bytes_of[e.name] = e.bytes;
            }
        EXPECT_EQ(p.class_bytes(MemClass::Gradients), whole.class_bytes(MemClass::Gradients));
        EXPECT_LT(p.total_bytes(), whole.total_bytes()) << "rank " << rank;
        if (rank == 0)
            for (const PlanEntry& e : p.entries())
                if (e.cls == MemClass::Parameters && e.dtype == DType::F32 && is_read(e.name))
                    everywhere += e.bytes;
        const size_t quarter = (sharded_bytes(whole) - everywhere) / 4;
        EXPECT_LE(sharded_bytes(p), everywhere + quarter + largest_whole) << "rank " << rank;
    }
    ASSERT_GT(everywhere, 0u);
    const size_t embedding = size_t(154880) * 6144 * 4;  // fp32 bytes of the whole matrix
    int split_masters = 0;
    for (const auto& [name, count] : ranks_with) {
        const bool state = name.find(".exp_avg") != std::string::npos ||
                           name.find(".momentum_buffer") != std::string::npos;
        if (is_split(name)) {
            // Each rank's rows: a master named by its rows on one rank, the moments on all four.
            EXPECT_EQ(count, state ? 4 : 1) << name;
            EXPECT_EQ(bytes_of[name], embedding / 4) << name;
            split_masters += !state;
            continue;
        }
        EXPECT_EQ(count, is_read(name) && !state ? 4 : 1) << name;
    }
    EXPECT_EQ(split_masters, 2 * 4);  // the embedding's and the output layer's, four rows each
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// The seed's formal workload (glm5.2-proxy-16gpu-thd4k: EP16 x DP16, THD4K, the distributed
// optimizer, FP8 weights gathered, the paged stash) plans at most 150 GiB on every one of its 16
// GPUs with the full-iteration graph and the expert exchange's buffers, as written and on Hopper
// (overlays/h200.yaml: blockwise FP8): below the seed's own measured eager peak, 158.3 GiB on
// GB200.
TEST(Plan, SeedProxyPlansAtMost150GiBOnEveryRank) {
#if SPARSETRON_WITH_CUDA
    const std::string dir = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/";
    for (const std::string overlay : {"", ",overlays/h200.yaml"}) {
        std::string recipe = dir + "glm5.2-proxy-16gpu-thd4k.yaml";
        if (!overlay.empty()) recipe += "," + dir + overlay.substr(1);
        const Recipe r = load_recipe(recipe, {"cuda_graph_impl=full_iteration"});
        auto tp = make_training_plan(r, Device::CUDA);
        size_t most = 0;
        for (int rank = 0; rank < 16; ++rank) {
            size_t total = 0;
            format_cuda_plan(r, *tp->params, tp->max_documents, tp->chunk_rows, &total, 1, {},
                             rank);
            EXPECT_LE(double(total), 150.0 * double(size_t(1) << 30)) << recipe << " rank " << rank;
            most = std::max(most, total);
        }
        std::cout << "[plan] " << recipe.substr(dir.size()) << ": at most "
                  << format_bytes(double(most)) << " per GPU\n";
    }
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// The one-GPU proxy on an H100 (80 GB, about 78 GiB usable): as written it needs an H200 (110 GiB
// at 4K); with overlays/h100.yaml (recompute, the routed experts' rows offloaded, the optimizer's
// masters and state in host memory) it plans at most 78 GiB at 4K, 8K, 16K and 32K tokens, and
// its backbone (no MTP, no indexer loss: the FP8 comparisons' measure) at most 76 GiB.
TEST(Plan, ProxyPlansWithinAnH100WithItsOverlayFrom4KTo32K) {
#if SPARSETRON_WITH_CUDA
    const std::string dir = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/";
    const double gib = double(size_t(1) << 30);
    auto plan_total = [&](const std::string& recipe, int64_t length, bool backbone = false) {
        std::vector<std::string> sets = {cat("seq_length=", length)};
        if (backbone) sets.insert(sets.end(), {"mtp_num_layers=0", "dsa_indexer_loss_coeff=0"});
        const Recipe r = load_recipe(recipe, sets);
        auto tp = make_training_plan(r, Device::CUDA);
        size_t total = 0;
        format_cuda_plan(r, *tp->params, tp->max_documents, tp->chunk_rows, &total, 1, {}, 0);
        return double(total);
    };
    EXPECT_GT(plan_total(dir + "glm5.2-proxy-h200.yaml", 4096), 100 * gib);
    for (int64_t length : {4096, 8192, 16384, 32768}) {
        const double total =
            plan_total(dir + "glm5.2-proxy-h200.yaml," + dir + "overlays/h100.yaml", length);
        const double backbone =
            plan_total(dir + "glm5.2-proxy-h200.yaml," + dir + "overlays/h100.yaml", length, true);
        std::cout << "[plan] proxy + h100 at " << length << ": " << format_bytes(total)
                  << ", its backbone " << format_bytes(backbone) << "\n";
        EXPECT_LE(total, 78 * gib) << length;
        EXPECT_LE(backbone, 76 * gib) << length;
        EXPECT_LT(backbone, total) << length;
    }
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// The seed's long-context recipes (EP16 x dynamic CP16; EP64 x dynamic CP64; PP4 x EP64 x dynamic
// CP64) with overlays/fit-gb200.yaml (the expert-parallel receive budget, 256 documents per
// micro-batch, attention recompute) plan at most 180 GiB on every rank, every pipeline stage of
// the 256-GPU recipe included, with the expert exchange's buffers: within a GB200's 186 GB. As
// written (dropless receive rows, 4096+ documents) each needs several times that. With the
// Hopper overlay and overlays/fit-h200.yaml on top (every recompute module, the optimizer's
// masters and state in host memory) at most 131 GiB: within an H200.
TEST(Plan, SeedLongContextRecipesPlanWithinAGb200AndAnH200WithTheirOverlays) {
#if SPARSETRON_WITH_CUDA
    const std::string dir = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/";
    for (const std::string name : {"glm5.2-16gpu", "glm5.2-64gpu", "glm5.2-256gpu"}) {
        for (const bool overlay : {false, true}) {
            const std::string path =
                dir + name + ".yaml" + (overlay ? "," + dir + "overlays/fit-gb200.yaml" : "");
            const Recipe r = load_recipe(path);
            const int world = int(r.run.world_size),
                      stages = int(r.run.pipeline_model_parallel_size);
            const ParallelLayout layout = make_layout(r.run, world);
            std::vector<std::unique_ptr<TrainingPlan>> by_stage(static_cast<size_t>(stages));
            size_t most = 0;
            // Every rank with the overlay; as written, each stage's first rank (the largest).
            for (int rank = 0; rank < world; ++rank) {
                const int s = stages == 1 ? 0 : layout.pp_rank(rank);
                if (!overlay && layout.stage_rank(rank) != 0) continue;
                const PipelineStage stage =
                    stages == 1 ? PipelineStage{} : pipeline_stage(r.model, r.run, s);
                if (!by_stage[size_t(s)])
                    by_stage[size_t(s)] = make_training_plan(r, Device::CUDA, stage);
                const TrainingPlan& tp = *by_stage[size_t(s)];
                size_t total = 0;
                format_cuda_plan(r, *tp.params, tp.max_documents, tp.chunk_rows, &total, 0, {stage},
                                 layout.stage_rank(rank));
                if (overlay) {
                    EXPECT_LE(double(total), 180.0 * double(size_t(1) << 30))
                        << name << " rank " << rank;
                }
                most = std::max(most, total);
            }
            if (!overlay) {
                EXPECT_GT(double(most), 360.0 * double(size_t(1) << 30)) << name;
            }
            std::cout << "[plan] " << name << (overlay ? " + fit-gb200" : " as written")
                      << ": at most " << format_bytes(double(most)) << " per GPU\n";
        }
        // On an H200: blockwise FP8, every recompute module, the optimizer offloaded; at most
        // 131 GiB on every rank (each stage's first and last rank: the distributed optimizer's
        // shares differ by a few MiB).
        const Recipe h = load_recipe(dir + name + ".yaml," + dir + "overlays/h200.yaml," + dir +
                                     "overlays/fit-gb200.yaml," + dir + "overlays/fit-h200.yaml");
        const int world = int(h.run.world_size), stages = int(h.run.pipeline_model_parallel_size);
        const ParallelLayout layout = make_layout(h.run, world);
        size_t most = 0;
        for (int rank = 0; rank < world; ++rank) {
            const int per_stage = world / stages, in_stage = rank % per_stage;
            if (in_stage != 0 && in_stage != per_stage - 1 && in_stage != per_stage / 2) continue;
            const int s = stages == 1 ? 0 : layout.pp_rank(rank);
            const PipelineStage stage =
                stages == 1 ? PipelineStage{} : pipeline_stage(h.model, h.run, s);
            auto tp = make_training_plan(h, Device::CUDA, stage);
            size_t total = 0;
            format_cuda_plan(h, *tp->params, tp->max_documents, tp->chunk_rows, &total, 0, {stage},
                             layout.stage_rank(rank));
            EXPECT_LE(double(total), 131.0 * double(size_t(1) << 30)) << name << " rank " << rank;
            most = std::max(most, total);
        }
        std::cout << "[plan] " << name << " + h200, fit-gb200, fit-h200: at most "
                  << format_bytes(double(most)) << " per GPU\n";
    }
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// Optimizer offload (optimizer_cpu_offload; planned without a GPU): on the proxy (one rank, so
// every master is this rank's) the masters of the trainable parameters and all optimizer state
// move to the host class, and the device plan shrinks by exactly what the host class gained; the
// router biases' masters (not trained) and the routers' (a cuBLASLt GEMM reads them) stay. Half the
// fraction moves about half the masters' bytes, in parameter order.
TEST(Plan, OptimizerOffloadPlansMastersAndStateInHostMemory) {
#if SPARSETRON_WITH_CUDA
    const std::string recipe =
        std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml";
    const auto plan_of = [&](const std::vector<std::string>& sets) {
        const Recipe r = load_recipe(recipe, sets);
        auto tp = make_training_plan(r, Device::CUDA);
        return cuda_memory_plan(r, *tp->params, tp->max_documents, tp->chunk_rows);
    };
    const MemoryPlan base = plan_of({}), all = plan_of({"optimizer_cpu_offload=true"}),
                     half =
                         plan_of({"optimizer_cpu_offload=true", "optimizer_offload_fraction=0.5"});
    EXPECT_EQ(base.host_offload_bytes(), 0u);
    EXPECT_LT(all.class_bytes(MemClass::OptimizerState), 2u << 20) << "the routers' state alone";
    EXPECT_GT(all.host_offload_bytes(), 0u);
    EXPECT_EQ(base.total_bytes() - all.total_bytes(), all.host_offload_bytes());
    const auto is_state = [](const std::string& n) {
        for (const std::string tail : {".exp_avg", ".exp_avg_sq", ".momentum_buffer"})
            if (n.size() > tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0)
                return true;
        return false;
    };
    const auto host_masters = [&](const MemoryPlan& p) {
        size_t bytes = 0;
        for (const PlanEntry& e : p.entries())
            if (e.cls == MemClass::HostOffload && !is_state(e.name)) bytes += e.bytes;
        return bytes;
    };
    size_t masters = 0;
    for (const PlanEntry& e : base.entries())
        if (e.cls == MemClass::Parameters && e.dtype == DType::F32) masters += e.bytes;
    // Every fp32 master on the host but the router biases' (not trained: the bias rule updates
    // them) and the routers' (their fp32 GEMM reads them), which stay on the device.
    size_t kept = 0;
    for (const PlanEntry& e : all.entries())
        if (e.cls == MemClass::Parameters && e.dtype == DType::F32) {
            EXPECT_TRUE(e.name.find("e_score_correction_bias") != std::string::npos ||
                        e.name.find("mlp.gate.weight") != std::string::npos)
                << e.name;
            kept += e.bytes;
        }
    EXPECT_EQ(host_masters(all) + kept, masters);
    EXPECT_LE(double(host_masters(half)), 0.5 * double(masters));
    EXPECT_GT(double(host_masters(half)), 0.4 * double(masters));
    for (const PlanEntry& e : all.entries()) {
        if (is_state(e.name)) {
            const bool router = e.name.find("mlp.gate.weight") != std::string::npos;
            EXPECT_EQ(e.cls, router ? MemClass::OptimizerState : MemClass::HostOffload) << e.name;
        }
    }
    std::cout << "[plan] proxy with the optimizer offloaded: "
              << format_bytes(double(all.total_bytes())) << " on the device (from "
              << format_bytes(double(base.total_bytes())) << "), "
              << format_bytes(double(all.host_offload_bytes())) << " in host memory\n";
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// grad_reduce_in_bf16 (planned without a GPU): on the proxy, the gradients of the weights that
// only GEMMs write (attention and indexer projections, dense, shared and routed experts, eh_proj,
// the output layer) are bf16 buffers, 2 bytes an element; the embedding's, the router's and the
// norms' stay fp32; without the key every gradient is fp32. The class shrinks by the sum of its
// entries' halves and nothing else changes; on the 4-layer proxy the embedding's fp32 gradient
// is a sixth of the gradients, so they shrink to under 60% (a 78-layer model's, to about half).
TEST(Plan, Bf16GradientBuffersHalveTheGemmWeightsGradients) {
#if SPARSETRON_WITH_CUDA
    const MemoryPlan fp32 = proxy_device_plan({});
    const MemoryPlan half = proxy_device_plan({"grad_reduce_in_bf16=true"});
    std::map<std::string, DType> type;
    size_t expected = 0;
    for (const PlanEntry& e : fp32.entries()) {
        if (e.cls != MemClass::Gradients) continue;
        EXPECT_EQ(e.dtype, DType::F32) << e.name;
        ASSERT_EQ(e.name.substr(e.name.size() - 5), ".grad");
        const std::string param = e.name.substr(0, e.name.size() - 5);
        const bool b = cuda::bf16_gradient_allowed(param);
        type[e.name] = b ? DType::BF16 : DType::F32;
        expected += b ? e.bytes / 2 : e.bytes;
    }
    size_t seen = 0;
    for (const PlanEntry& e : half.entries()) {
        if (e.cls != MemClass::Gradients) continue;
        ASSERT_TRUE(type.count(e.name)) << e.name;
        EXPECT_EQ(e.dtype, type[e.name]) << e.name;
        ++seen;
    }
    EXPECT_EQ(seen, type.size());
    // The rule on names of each kind.
    EXPECT_EQ(type.at("model.embed_tokens.weight.grad"), DType::F32);
    EXPECT_EQ(type.at("model.norm.weight.grad"), DType::F32);
    EXPECT_EQ(type.at("model.layers.3.mlp.gate.weight.grad"), DType::F32);  // the router
    EXPECT_EQ(type.at("model.layers.3.self_attn.q_b_proj.weight.grad"), DType::BF16);
    EXPECT_EQ(type.at("model.layers.3.mlp.experts.0.down_proj.weight.grad"), DType::BF16);
    EXPECT_EQ(type.at("lm_head.weight.grad"), DType::BF16);
    const size_t before = fp32.class_bytes(MemClass::Gradients),
                 after = half.class_bytes(MemClass::Gradients);
    // The class's arena adds alignment between entries: the sum of the entries, within 1%.
    EXPECT_NEAR(double(after), double(expected), 0.01 * double(expected));
    EXPECT_LT(double(after), 0.6 * double(before));
    for (const MemClass c : {MemClass::Parameters, MemClass::OptimizerState, MemClass::Activations})
        EXPECT_EQ(half.class_bytes(c), fp32.class_bytes(c));
    std::cout << "[plan] proxy gradients: " << format_bytes(double(before)) << " fp32, "
              << format_bytes(double(after)) << " with grad_reduce_in_bf16\n";
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// fp8_output_proj (planned without a GPU): the head's FP8 W and W^T and its operands' scratch
// are planned; the head's bf16 copy stays only where the e2e TV loss reads it (the proxy's MTP).
TEST(Plan, Fp8OutputProjPlansTheHeadsFp8CopyAndDropsAnUnreadBf16One) {
#if SPARSETRON_WITH_CUDA
    const std::vector<std::string> fp8 = {"fp8_recipe=blockwise"};
    std::vector<std::string> head = fp8;
    head.push_back("fp8_output_proj=true");
    for (const bool mtp : {false, true}) {
        std::vector<std::string> a = fp8, b = head;
        if (!mtp) a.push_back("mtp_num_layers=0"), b.push_back("mtp_num_layers=0");
        const MemoryPlan off = proxy_device_plan(a), on = proxy_device_plan(b);
        EXPECT_FALSE(plan_has(off, "lm_head.weight.fp8"));
        EXPECT_TRUE(plan_has(on, "lm_head.weight.fp8")) << "mtp " << mtp;
        EXPECT_TRUE(plan_has(on, "head.fp8_operand_a")) << "mtp " << mtp;
        EXPECT_TRUE(plan_has(off, "lm_head.weight.bf16"));
        EXPECT_EQ(plan_has(on, "lm_head.weight.bf16"), mtp) << "mtp " << mtp;
    }
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}

// fp8_param_gather (planned without a GPU): on the proxy at DP4 with the blockwise FP8 recipe,
// an FP8 linear's fp32 master is planned on its owner alone, which broadcasts the FP8 copy every
// rank plans; without the key every rank keeps the master its quantizer reads. The routed
// experts' masters stay where their FP8 copies are quantized (each rank, without expert
// parallelism sharding them here: every rank).
TEST(Plan, Fp8ParamGatherKeepsTheFp8LinearsMastersOnTheirOwners) {
#if SPARSETRON_WITH_CUDA
    for (const bool gather : {false, true}) {
        const Recipe r = load_recipe(
            std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml",
            {"world_size=4", "global_batch_size=4", "use_distributed_optimizer=true",
             "fp8_recipe=blockwise", cat("fp8_param_gather=", gather ? "true" : "false")});
        auto tp = make_training_plan(r, Device::CUDA);
        std::map<std::string, int> ranks_with;  // plan entry -> ranks planning it
        for (int rank = 0; rank < 4; ++rank) {
            const MemoryPlan p =
                cuda_memory_plan(r, *tp->params, tp->max_documents, tp->chunk_rows, {}, rank);
            for (const PlanEntry& e : p.entries()) ++ranks_with[e.name];
        }
        for (const std::string linear :
             {"model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight",
              "model.layers.3.mlp.shared_experts.down_proj.weight"}) {
            SCOPED_TRACE(cat(linear, gather ? " gathered" : " not gathered"));
            EXPECT_EQ(ranks_with[linear + ".fp8"], 4);
            EXPECT_EQ(ranks_with[linear], gather ? 1 : 4);  // the fp32 master
            EXPECT_EQ(ranks_with[linear + ".bf16"], 0);
        }
        EXPECT_EQ(ranks_with["model.layers.3.mlp.experts.0.up_proj.weight"], 4);
        EXPECT_EQ(ranks_with["model.layers.3.mlp.experts.0.up_proj.weight.momentum_buffer"], 1);
    }
    // Megatron's rule: the FP8 weights are gathered by the distributed optimizer.
    EXPECT_THROW(load_recipe(std::string(SPARSETRON_SOURCE_DIR) + "/recipes/glm5.2-proxy-h200.yaml",
                             {"fp8_param_gather=true", "use_distributed_optimizer=false"}),
                 Error);
#else
    GTEST_SKIP() << "built without CUDA: no device plan";
#endif
}
