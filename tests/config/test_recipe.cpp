#include <gtest/gtest.h>

#include <fstream>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/error.h"
#include "test_util.h"

using namespace sparsetron;

namespace {
std::string repo(const std::string& rel) {
    return std::string(SPARSETRON_SOURCE_DIR) + "/" + rel;
}

using test::error_of;
}  // namespace

TEST(MoeLayerFreq, ParsesTheSeedExpression) {
    auto v = parse_moe_layer_freq("([0]*2+[1]*19)", 21);
    ASSERT_EQ(v.size(), 21u);
    EXPECT_EQ(v[0], 0);
    EXPECT_EQ(v[1], 0);
    EXPECT_EQ(v[2], 1);
    EXPECT_EQ(v[20], 1);
    EXPECT_EQ(parse_moe_layer_freq("[0, 1, 1]", 3), (std::vector<int>{0, 1, 1}));
    EXPECT_EQ(parse_moe_layer_freq("2", 4), (std::vector<int>{1, 0, 1, 0}));
    EXPECT_EQ(parse_moe_layer_freq("([0]+[1])*2", 4), (std::vector<int>{0, 1, 0, 1}));
}

TEST(MoeLayerFreq, RejectsOtherGrammar) {
    EXPECT_NE(error_of([] { parse_moe_layer_freq("([0]*2+[1]*19", 21); }).find("expected ')'"),
              std::string::npos);
    EXPECT_NE(
        error_of([] { parse_moe_layer_freq("[0]*2+[1]*18", 21); }).find("describes 20 layers"),
        std::string::npos);
    EXPECT_NE(error_of([] { parse_moe_layer_freq("[2]*21", 21); }).find("0 (dense) or 1"),
              std::string::npos);
    EXPECT_FALSE(error_of([] { parse_moe_layer_freq("__import__('os')", 21); }).empty());
    EXPECT_FALSE(error_of([] { parse_moe_layer_freq("0", 3); }).empty());
}

TEST(Recipe, SeedRecipesParseAndValidate) {
    Recipe r = load_recipe(repo("recipes/glm5.2-16gpu.yaml"));
    EXPECT_EQ(r.model.num_layers, 21);
    EXPECT_EQ(r.model.num_moe_layers(), 19);
    EXPECT_EQ(r.model.num_experts, 64);
    EXPECT_EQ(r.model.q_head_dim(), 256);
    EXPECT_EQ(r.model.dsa_indexer_topk, 2048);
    EXPECT_EQ(r.model.mtp_loss_type, "e2e_tv");
    EXPECT_EQ(r.run.fp8_recipe, "mxfp8");
    EXPECT_EQ(r.run.optimizer, "muon");
    EXPECT_EQ(r.run.expert_model_parallel_size, 16);
    EXPECT_EQ(r.run.data_parallel_size(), 1);
    EXPECT_EQ(r.run.microbatches_per_step(), 8);
    Recipe r64 = load_recipe(repo("recipes/glm5.2-64gpu.yaml"));
    EXPECT_EQ(r64.model.num_experts, 256);
    Recipe r256 = load_recipe(repo("recipes/glm5.2-256gpu.yaml"));
    EXPECT_EQ(r256.model.num_layers, 78);
    EXPECT_EQ(r256.model.num_dense_layers(), 3);
    EXPECT_EQ(r256.run.pipeline_model_parallel_size, 4);
    // GLM-5.2's released offset 3: every stage of 18/20/20/20 starts on a full layer; the MTP
    // layer computes its own indexer, with kv sharing across the MTP depths.
    EXPECT_EQ(r256.model.dsa_indexer_skip_topk_offset, 3);
    EXPECT_TRUE(r256.model.dsa_mtp_index_kv_share);
    EXPECT_TRUE(dsa_layer_is_full(r256.model, r256.model.num_layers));
    for (int64_t first : {18, 38, 58}) EXPECT_TRUE(dsa_layer_is_full(r256.model, first));
}

// A recipe and its overlays: "base,overlay" applies each file's keys over the ones before, then
// --set; the Hopper overlay turns the seed's mxfp8 into blockwise FP8 and touches nothing else.
TEST(Recipe, OverlaysReplaceTheBaseKeys) {
    const Recipe seed = load_recipe(repo("recipes/glm5.2-16gpu.yaml"));
    const Recipe hopper =
        load_recipe(repo("recipes/glm5.2-16gpu.yaml") + "," + repo("recipes/overlays/h200.yaml"));
    EXPECT_EQ(hopper.run.fp8_recipe, "blockwise");
    EXPECT_EQ(hopper.run.fp8_format, "e4m3");
    Recipe back = hopper;
    back.run.fp8_recipe = seed.run.fp8_recipe;
    EXPECT_EQ(back.to_yaml(), seed.to_yaml());
    // --set still comes last; a missing overlay is named.
    const Recipe set =
        load_recipe(repo("recipes/glm5.2-16gpu.yaml") + "," + repo("recipes/overlays/h200.yaml"),
                    {"fp8_recipe="});
    EXPECT_EQ(set.run.fp8_recipe, "");
    const std::string msg = error_of(
        [] { load_recipe(repo("recipes/tiny.yaml") + "," + repo("recipes/overlays/none.yaml")); });
    EXPECT_NE(msg.find("cannot read recipe file '" + repo("recipes/overlays/none.yaml") + "'"),
              std::string::npos)
        << msg;
}

TEST(Recipe, TinyYamlEqualsTheBuiltinRecipe) {
    Recipe file = load_recipe(repo("recipes/tiny.yaml"));
    EXPECT_EQ(file.to_yaml(), builtin_tiny_recipe().to_yaml());
}

TEST(Recipe, UnknownKeySuggestsTheClosest) {
    std::string msg = error_of([] { load_recipe("", {"hiden_size=64"}); });
    EXPECT_NE(msg.find("unknown recipe key 'hiden_size'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("did you mean 'hidden_size'"), std::string::npos) << msg;
    auto settings = parse_recipe_yaml("num_layers: 2\nnum_attention_head: 4\n", "x.yaml");
    Recipe r;
    r.apply(settings[0]);
    msg = error_of([&] { r.apply(settings[1]); });
    EXPECT_NE(msg.find("x.yaml:2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("num_attention_heads"), std::string::npos) << msg;
    // Common HF / PyTorch names get Megatron's (learning_rate suggested rotary_base); a key far
    // from every known one gets no guess.
    msg = error_of([] { load_recipe("", {"learning_rate=1e-4"}); });
    EXPECT_NE(msg.find("Megatron's name for it is 'lr'"), std::string::npos) << msg;
    msg = error_of([] { load_recipe("", {"num_hidden_layers=4"}); });
    EXPECT_NE(msg.find("'num_layers'"), std::string::npos) << msg;
    msg = error_of([] { load_recipe("", {"completely_unrelated_setting=1"}); });
    EXPECT_NE(msg.find("no key is close; `sparsetron keys` lists every key"), std::string::npos)
        << msg;
}

TEST(Recipe, BadValuesNameTheKey) {
    EXPECT_NE(error_of([] { load_recipe("", {"hidden_size=abc"}); }).find("hidden_size"),
              std::string::npos);
    EXPECT_NE(
        error_of([] { load_recipe("", {"hidden_size=0"}); }).find("'hidden_size' must be > 0"),
        std::string::npos);
    EXPECT_NE(error_of([] { load_recipe("", {"bf16=maybe"}); }).find("true or false"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe("", {"tensor_model_parallel_size=3"});
              }).find("num_attention_heads (4) must be divisible by tensor_model_parallel_size"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe("", {"global_batch_size=7", "world_size=2"});
              }).find("global_batch_size (7)"),
              std::string::npos);
    EXPECT_NE(error_of([] { load_recipe("", {"qk_pos_emb_head_dim=15"}); }).find("even"),
              std::string::npos);
    EXPECT_NE(
        error_of([] {
            load_recipe("", {"mtp_num_layers=2", "mtp_loss_type=e2e_tv", "mtp_detach_heads=false"});
        }).find("requires mtp_detach_heads"),
        std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe(
                      "", {"moe_layer_freq=[0,1]", "num_experts=6", "moe_ffn_hidden_size=8",
                           "moe_router_topk=2", "expert_model_parallel_size=4", "world_size=4"});
              }).find("num_experts (6) must be divisible by expert_model_parallel_size (4)"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe("", {"experimental_attention_variant=dsa", "dsa_indexer_n_heads=2",
                                   "dsa_indexer_head_dim=32", "dsa_indexer_topk=0"});
              }).find("'dsa_indexer_topk' must be > 0"),
              std::string::npos);
    EXPECT_NE(error_of([] { load_recipe("", {"lr_decay_style=exp"}); }).find("cosine"),
              std::string::npos);
}

TEST(Recipe, OverridesApplyAfterTheFile) {
    Recipe r = load_recipe(repo("recipes/tiny.yaml"), {"train_iters=7", "lr=1e-4", "min_lr=1e-5",
                                                       "data_path=[0.3, a, 0.7, b]"});
    EXPECT_EQ(r.run.train_iters, 7);
    EXPECT_DOUBLE_EQ(r.run.lr, 1e-4);
    EXPECT_EQ(r.run.data_path, (std::vector<std::string>{"0.3", "a", "0.7", "b"}));
    Recipe s = load_recipe("", {"data_path=0.5 x 0.5 y"});
    EXPECT_EQ(s.run.data_path.size(), 4u);
}

TEST(Recipe, InvalidYamlNamesTheFileAndLine) {
    std::string msg = error_of([] { parse_recipe_yaml("a: 1\nb: [1, 2\n", "bad.yaml"); });
    EXPECT_NE(msg.find("bad.yaml"), std::string::npos) << msg;
    EXPECT_NE(error_of([] { load_recipe("/nonexistent/recipe.yaml"); }).find("/nonexistent"),
              std::string::npos);
}

// Megatron's selective recompute keys: the modules the CUDA backend recomputes pass, whole-layer
// recompute and other modules are refused naming what exists.
TEST(Recipe, RecomputeKeysNameWhatExists) {
    const Recipe r = load_recipe(
        "", {"recompute_granularity=selective", "recompute_modules=core_attn mla_up_proj"});
    EXPECT_TRUE(r.model.activation().recomputes(RecomputeModule::CoreAttn));
    EXPECT_TRUE(r.model.activation().recomputes(RecomputeModule::MlaUpProj));
    EXPECT_FALSE(r.model.activation().recomputes(RecomputeModule::Layernorm));
    EXPECT_FALSE(load_recipe("", {"recompute_modules=core_attn"})
                     .model.activation()
                     .recomputes(RecomputeModule::CoreAttn))
        << "modules without recompute_granularity: selective recompute nothing";
    std::string msg = error_of([] { load_recipe("", {"recompute_granularity=full"}); });
    EXPECT_NE(msg.find("recompute_granularity: full (whole-layer recompute) is not implemented"),
              std::string::npos)
        << msg;
    msg = error_of([] {
        load_recipe("",
                    {"recompute_granularity=selective", "recompute_modules=moe shared_experts"});
    });
    EXPECT_NE(msg.find("'recompute_modules' is \"moe\"; expected one of: core_attn, layernorm, "
                       "mla_up_proj, mlp, moe_act, shared_experts"),
              std::string::npos)
        << msg;
}

// Megatron's fine-grained activation offload keys: the modules pass (fused_group_mlp names the
// routed experts' expert_fc1, moe_act and output rows); an empty list, an unknown module, a module
// also recomputed or one the paged stash already holds are refused naming the keys.
TEST(Recipe, OffloadKeysNameWhatExists) {
    const Recipe r = load_recipe("", {"fine_grained_activation_offloading=true",
                                      "offload_modules=core_attn fused_group_mlp"});
    const ActivationPolicy a = r.model.activation();
    EXPECT_TRUE(a.offloads(OffloadModule::CoreAttn));
    EXPECT_TRUE(a.offloads(OffloadModule::ExpertFc1));
    EXPECT_TRUE(a.offloads(OffloadModule::MoeAct));
    EXPECT_TRUE(a.offloads(OffloadModule::ExpertOut));
    EXPECT_FALSE(a.offloads(OffloadModule::AttnProj));
    EXPECT_FALSE(load_recipe("", {"offload_modules=core_attn"})
                     .model.activation()
                     .offloads(OffloadModule::CoreAttn))
        << "modules without fine_grained_activation_offloading offload nothing";
    EXPECT_FALSE(
        load_recipe("", {"fine_grained_activation_offloading=true", "offload_modules=expert_fc1"})
            .model.activation()
            .offloads(OffloadModule::ExpertOut));
    std::string msg =
        error_of([] { load_recipe("", {"fine_grained_activation_offloading=true"}); });
    EXPECT_NE(msg.find("fine_grained_activation_offloading: true needs offload_modules"),
              std::string::npos)
        << msg;
    msg = error_of([] {
        load_recipe("", {"fine_grained_activation_offloading=true", "offload_modules=mlp"});
    });
    EXPECT_NE(msg.find("'offload_modules' is \"mlp\"; expected one of: attn_norm, attn_proj, "
                       "core_attn, expert_fc1, fused_group_mlp, mlp_norm, moe_act, qkv_linear"),
              std::string::npos)
        << msg;
    msg = error_of([] {
        load_recipe("", {"fine_grained_activation_offloading=true", "offload_modules=attn_proj",
                         "recompute_granularity=selective", "recompute_modules=core_attn"});
    });
    EXPECT_NE(msg.find("offload_modules names attn_proj and recompute_modules names core_attn"),
              std::string::npos)
        << msg;
    msg = error_of([] {
        load_recipe("", {"fine_grained_activation_offloading=true", "offload_modules=moe_act",
                         "moe_paged_stash=true"});
    });
    EXPECT_NE(msg.find("offload_modules names moe_act, whose activations moe_paged_stash"),
              std::string::npos)
        << msg;
}

TEST(HfConfig, RoundTripsTheModelConfig) {
    Recipe r = load_recipe(repo("recipes/glm5.2-16gpu.yaml"));
    ModelConfig back = parse_hf_config(hf_config_json(r.model), "mem");
    EXPECT_EQ(back.hidden_size, 6144);
    EXPECT_EQ(back.qk_head_dim, 192);
    EXPECT_EQ(back.qk_pos_emb_head_dim, 64);
    EXPECT_EQ(back.moe_layer_pattern, r.model.moe_layer_pattern);
    EXPECT_EQ(back.moe_shared_expert_intermediate_size, 2048);
    EXPECT_EQ(back.dsa_indexer_topk_freq, 4);
    EXPECT_EQ(back.dsa_indexer_skip_topk_offset, 2);
    EXPECT_DOUBLE_EQ(back.rotary_base, 8e6);
    EXPECT_TRUE(back.rotary_interleaved);
    // The repeated MTP layer is one next-n layer; distinct layers are one each, and come back so.
    EXPECT_EQ(r.model.mtp_num_layers, 7);
    EXPECT_EQ(back.mtp_num_layers, 1);
    ModelConfig distinct = r.model;
    distinct.mtp_num_layers = 3;
    distinct.mtp_use_repeated_layer = false;
    back = parse_hf_config(hf_config_json(distinct), "mem");
    EXPECT_EQ(back.mtp_num_layers, 3);
    EXPECT_FALSE(back.mtp_use_repeated_layer);
    EXPECT_FALSE(back.dsa_mtp_index_kv_share);
    EXPECT_NE(error_of([] {
                  parse_hf_config("{\"model_type\": \"llama\"}", "c.json");
              }).find("expected glm_moe_dsa"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  parse_hf_config("{\"model_type\": \"glm_moe_dsa\"}", "c.json");
              }).find("lacks required key 'vocab_size'"),
              std::string::npos);
}

TEST(IndexShare, Glm52ReleaseAndSeedPatterns) {
    ModelConfig m;
    m.num_layers = 78;
    m.dsa_indexer_topk_freq = 4;
    m.dsa_indexer_skip_topk_offset = 3;  // GLM-5.2 release: full 0,1,2,6,10,...,74 and MTP (78)
    std::vector<int64_t> full;
    for (int64_t l = 0; l <= 78; ++l)
        if (dsa_layer_is_full(m, l)) full.push_back(l);
    std::vector<int64_t> want = {0, 1, 2};
    for (int64_t l = 6; l <= 74; l += 4) want.push_back(l);
    want.push_back(78);
    EXPECT_EQ(full, want);
    EXPECT_EQ(full.size(), 22u);  // 21 backbone indexers plus the MTP layer's
    EXPECT_EQ(dsa_source_layer(m, 5), 2);
    EXPECT_EQ(dsa_source_layer(m, 7), 6);
    EXPECT_EQ(dsa_source_layer(m, 77), 74);
    m.dsa_indexer_skip_topk_offset = 2;  // the seed's recipe value: full 0,1,5,9,...
    EXPECT_TRUE(dsa_layer_is_full(m, 5));
    EXPECT_FALSE(dsa_layer_is_full(m, 2));
    EXPECT_FALSE(dsa_layer_is_full(m, 76));
    // The MTP layer is layer 1 of its block (Megatron's numbering), not 79: always full.
    EXPECT_TRUE(dsa_layer_is_full(m, 78));
    EXPECT_EQ(dsa_source_layer(m, 78), 78);
    m.mtp_use_repeated_layer = false;  // distinct MTP layers: each its block's layer 1
    EXPECT_TRUE(dsa_layer_is_full(m, 79));
    m.mtp_use_repeated_layer = true;
    m.indexer_types = {"full", "shared", "shared"};  // an explicit list wins
    EXPECT_FALSE(dsa_layer_is_full(m, 1));
    EXPECT_EQ(dsa_source_layer(m, 2), 0);
}

// Megatron's pipeline rule for IndexShare (its _validate_dsa_index_share_pipeline_split): a stage
// that starts on a shared layer is refused, since top-k never travels between stages; the seed's
// 18/20/20/20 split passes at GLM-5.2's offset 3 and is refused at the seed's offset 2.
TEST(IndexShare, PipelineStagesStartOnFullLayers) {
    const std::string r256 = repo("recipes/glm5.2-256gpu.yaml");
    EXPECT_NO_THROW(load_recipe(r256));
    const std::string msg =
        error_of([&] { load_recipe(r256, {"dsa_indexer_skip_topk_offset=2"}); });
    EXPECT_NE(msg.find("pipeline split is invalid: pipeline stage 1 starts on layer 19"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("comes from layer 18"), std::string::npos) << msg;
    ModelConfig m;
    m.num_layers = 8;
    m.dsa_indexer_topk_freq = 2;
    m.dsa_indexer_skip_topk_offset = 1;  // full 0, 2, 4, 6
    EXPECT_NO_THROW(check_index_share_pipeline_split(m, {2, 2, 4}));
    EXPECT_NE(error_of([&] {
                  check_index_share_pipeline_split(m, {2, 3, 3});
              }).find("pipeline stage 2 starts on layer 6 (1-based)"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  check_index_share_pipeline_split(m, {3, 5});
              }).find("pipeline stage 1 starts on layer 4 (1-based)"),
              std::string::npos);
    m.experimental_attention_variant = "none";  // no DSA: no rule
    EXPECT_NO_THROW(check_index_share_pipeline_split(m, {3, 5}));
}

// Megatron's gradient-buffer keys with Megatron's rules for bf16 training: fp32 accumulation and
// reduction by default; grad_reduce_in_bf16 asks for bf16 buffers (the CUDA plan's gradients,
// Plan.Bf16GradientBuffersHalveTheGemmWeightsGradients); accumulate_allreduce_grads_in_fp32:
// false alone stays fp32, as Megatron sets it back.
TEST(Recipe, GradientBufferKeysFollowMegatron) {
    const Recipe plain = load_recipe("", {});
    EXPECT_TRUE(plain.run.accumulate_allreduce_grads_in_fp32);
    EXPECT_FALSE(plain.run.grad_reduce_in_bf16);
    EXPECT_TRUE(load_recipe("", {"grad_reduce_in_bf16=true"}).run.grad_reduce_in_bf16);
    EXPECT_FALSE(
        load_recipe("", {"accumulate_allreduce_grads_in_fp32=false"}).run.grad_reduce_in_bf16);
}

// The CUDA graph keys as Megatron spells them: local (chunk-wise), full_iteration, the warm-up
// steps (default 3), the older cuda_graph_scope migrated, per-module scopes refused.
TEST(Recipe, CudaGraphKeysFollowMegatron) {
    EXPECT_EQ(load_recipe("", {}).run.cuda_graph_warmup_steps, 3);
    EXPECT_EQ(load_recipe("", {"cuda_graph_impl=local"}).run.cuda_graph_impl, "local");
    EXPECT_EQ(load_recipe("", {"cuda_graph_scope=full_iteration"}).run.cuda_graph_impl,
              "full_iteration");
    EXPECT_EQ(
        load_recipe("", {"cuda_graph_scope=full", "cuda_graph_impl=local"}).run.cuda_graph_impl,
        "local");
    EXPECT_NE(error_of([] {
                  load_recipe("", {"cuda_graph_scope=full_iteration", "cuda_graph_impl=local"});
              }).find("contradicts"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe("", {"cuda_graph_scope=attn"});
              }).find("recipe key 'cuda_graph_scope'"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe("", {"cuda_graph_modules=[attn,moe_router]"});
              }).find("cuda_graph_modules"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe("", {"cuda_graph_impl=transformer_engine"});
              }).find("cuda_graph_impl"),
              std::string::npos);
    EXPECT_NE(error_of([] {
                  load_recipe("", {"cuda_graph_warmup_steps=0"});
              }).find("cuda_graph_warmup_steps"),
              std::string::npos);
}

// Dynamic CP needs per-token loss, as Megatron requires (a micro-batch's mean of the indexer KL
// would depend on the grouping); the seed's dynamic-CP recipes set it.
TEST(Recipe, DynamicContextParallelNeedsPerTokenLoss) {
    const std::vector<std::string> dyn = {"world_size=2", "context_parallel_size=2",
                                          "dynamic_context_parallel=true",
                                          "sequence_packing_scheduler=default_dynamic_cp"};
    EXPECT_NE(error_of([&] {
                  load_recipe("", dyn);
              }).find("dynamic_context_parallel needs calculate_per_token_loss: true"),
              std::string::npos);
    std::vector<std::string> ok = dyn;
    ok.push_back("calculate_per_token_loss=true");
    EXPECT_NO_THROW(load_recipe("", ok));
    for (const char* r : {"glm5.2-16gpu.yaml", "glm5.2-64gpu.yaml", "glm5.2-256gpu.yaml"})
        EXPECT_TRUE(load_recipe(repo(std::string("recipes/") + r)).run.calculate_per_token_loss)
            << r;
}

// One value per key and file: a second one (it silently won) is refused with both lines, in the
// ARGS block and across it; overlays and --set remain the way to replace values.
TEST(Recipe, DuplicateKeysAreRefused) {
    std::string msg =
        error_of([] { parse_recipe_yaml("lr: 1e-3\nseed: 3\nlr: 2e-3\n", "r.yaml"); });
    EXPECT_NE(msg.find("r.yaml:3: recipe key 'lr' is already set at r.yaml:1"), std::string::npos)
        << msg;
    msg = error_of([] { parse_recipe_yaml("ARGS:\n  lr: 1e-3\nlr: 2e-3\n", "s.yaml"); });
    EXPECT_NE(msg.find("s.yaml:3: recipe key 'lr' is already set at s.yaml:2"), std::string::npos)
        << msg;
    EXPECT_EQ(parse_recipe_yaml("ARGS:\n  lr: 1e-3\nseed: 3\n", "ok.yaml").size(), 2u);
}

// Keys that would change nothing are refused with what to use instead (they were parsed and
// ignored): MTP kv sharing between distinct layers, fixed-length samples, an unknown DSA backend;
// the values that mean something here pass (Megatron's three DSA backends all run the engine's
// kernels; distinct MTP layers without kv sharing).
TEST(Recipe, KeysWithoutAnEffectAreRefused) {
    std::string msg = error_of([] {
        load_recipe("", {"mtp_num_layers=2", "mtp_use_repeated_layer=false",
                         "dsa_mtp_index_kv_share=true"});
    });
    EXPECT_NE(msg.find("with mtp_use_repeated_layer: false each depth's own layer computes its "
                       "keys: set dsa_mtp_index_kv_share: false"),
              std::string::npos)
        << msg;
    EXPECT_EQ(load_recipe("", {"mtp_num_layers=3", "mtp_use_repeated_layer=false",
                               "dsa_mtp_index_kv_share=false"})
                  .model.mtp_physical_layers(),
              3);
    EXPECT_EQ(load_recipe("", {"mtp_num_layers=3"}).model.mtp_physical_layers(), 1);
    msg = error_of([] { load_recipe("", {"use_varlen_dataset=false"}); });
    EXPECT_NE(msg.find("use_varlen_dataset: false (fixed-length samples) is not implemented"),
              std::string::npos)
        << msg;
    msg = error_of([] { load_recipe("", {"dsa_kernel_backend=flash"}); });
    EXPECT_NE(msg.find("'dsa_kernel_backend' is \"flash\"; expected one of: auto, cudnn, none, "
                       "tilelang"),
              std::string::npos)
        << msg;
    for (const char* b : {"auto", "none", "tilelang", "cudnn"})
        EXPECT_NO_THROW(load_recipe("", {std::string("dsa_kernel_backend=") + b})) << b;
}

// Validation keys: split names the key on a bad value and must leave documents to train on.
TEST(Recipe, SplitAndEvalKeys) {
    EXPECT_EQ(load_recipe("", {"split=969,30,1"}).run.split, "969,30,1");
    std::string msg = error_of([] { load_recipe("", {"split=0,1,0"}); });
    EXPECT_NE(msg.find("leaves no documents for training"), std::string::npos) << msg;
    msg = error_of([] { load_recipe("", {"split=a,b"}); });
    EXPECT_NE(msg.find("recipe key 'split'"), std::string::npos) << msg;
    msg = error_of([] { load_recipe("", {"eval_iters=-1"}); });
    EXPECT_NE(msg.find("recipe key 'eval_iters' must be >= 0, got -1"), std::string::npos) << msg;
}

// Megatron's pipeline layout string survives the recipe's YAML (the copy a checkpoint keeps): its
// `|`, `*`, parentheses and commas come back as written, from a file and from --set.
TEST(Recipe, PipelineLayoutRoundTripsThroughYaml) {
    const std::string layout = "Et*18|(t*20|)*2,t*20,m*7,L";
    const Recipe r = load_recipe(
        repo("recipes/glm5.2-256gpu.yaml"),
        {"pipeline_model_parallel_layout=" + layout, "decoder_first_pipeline_num_layers=0"});
    EXPECT_EQ(r.run.pipeline_model_parallel_layout, layout);
    const std::string path = test::temp_dir("recipe-layout") + "/r.yaml";
    std::ofstream(path) << r.to_yaml();
    const Recipe back = load_recipe(path);
    EXPECT_EQ(back.run.pipeline_model_parallel_layout, layout);
    EXPECT_EQ(back.to_yaml(), r.to_yaml());
}

// Interleaved virtual stages: the keys round-trip, and what the schedule cannot take is refused
// by name (micro-batches not a multiple of P); dynamic CP is taken.
TEST(Recipe, VirtualPipelineStagesNameWhatTheyNeed) {
    const std::vector<std::string> vpp = {"world_size=2",
                                          "pipeline_model_parallel_size=2",
                                          "num_layers=4",
                                          "moe_layer_freq=[0,1,1,1]",
                                          "dsa_indexer_topk_freq=1",
                                          "num_virtual_stages_per_pipeline_rank=2",
                                          "global_batch_size=4"};
    const Recipe r = load_recipe("", vpp);
    EXPECT_EQ(r.run.num_virtual_stages_per_pipeline_rank, 2);
    const std::string path = test::temp_dir("recipe-vpp") + "/r.yaml";
    std::ofstream(path) << r.to_yaml();
    EXPECT_EQ(load_recipe(path).run.num_virtual_stages_per_pipeline_rank, 2);
    std::vector<std::string> odd = vpp;
    odd.push_back("global_batch_size=3");
    EXPECT_NE(error_of([&] {
                  load_recipe("", odd);
              }).find("to be a multiple of pipeline_model_parallel_size"),
              std::string::npos);
    std::vector<std::string> dyn = vpp;
    for (const char* s :
         {"world_size=4", "context_parallel_size=2", "dynamic_context_parallel=true",
          "sequence_packing_scheduler=default_dynamic_cp", "calculate_per_token_loss=true"})
        dyn.push_back(s);
    // Under dynamic CP the step is padded to a multiple of P instead (the trainer's batches).
    EXPECT_NO_THROW(load_recipe("", dyn));
}
