// Starting a run from pretrained weights (Megatron's load / pretrained_checkpoint / finetune): an
// HF directory (config.json + safetensors, with FP8 e4m3 weights and 128x128 block scales as the
// DeepSeek-V3 / GLM releases ship them) or an engine checkpoint's weights start iteration 0 with
// fresh optimizer state; the MTP layer, which HF checkpoints lack, keeps its initialization.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/io/safetensors.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

Recipe two_step_recipe(std::vector<std::string> extra = {}) {
    std::vector<std::string> sets = test::small_model_sets();
    sets.insert(sets.end(), {"global_batch_size=2", "train_iters=2", "lr_warmup_iters=1"});
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_recipe("", sets);
}

const char* kFp8Name = "model.layers.0.self_attn.q_a_proj.weight";

// A trained engine checkpoint and an HF directory made from it: config.json, and every tensor but
// the MTP layer's, `kFp8Name` stored as F8_E4M3 with its weight_scale_inv (`drop`: one more
// tensor left out; `no_scale`: the FP8 tensor's scales left out).
struct Source {
    std::string ckpt, hf;
};
Source make_source(const std::string& dir, const std::string& drop = "", bool no_scale = false) {
    Source s;
    {
        Trainer t(two_step_recipe(), {dir + "/run", "", Device::CPU});
        t.run();
        s.ckpt = t.checkpoint_dir() + "/iter_0000002";
    }
    s.hf = dir + "/hf";
    fs::create_directories(s.hf);
    fs::copy_file(s.ckpt + "/config.json", s.hf + "/config.json");
    SafetensorsFile src(s.ckpt + "/model.safetensors");
    Trainer probe(two_step_recipe(), {dir + "/probe", "", Device::CPU});
    std::set<std::string> mtp;
    for (const auto& p : probe.params().params())
        if (p.mtp) mtp.insert(p.name);
    std::vector<SafetensorsEntry> entries;
    std::vector<uint8_t> q;
    std::vector<float> scale;
    for (const auto& [name, info] : src.tensors()) {
        if (mtp.count(name) || name == drop) continue;
        if (name == kFp8Name) {
            const int64_t rows = info.shape[0], cols = info.shape[1];
            q.resize(size_t(rows * cols));
            scale.resize(size_t(((rows + 127) / 128) * ((cols + 127) / 128)));
            cpu::quantize_128x128(reinterpret_cast<const float*>(info.data), rows, cols, false,
                                  q.data(), scale.data());
            entries.push_back({name, DType::F8E4M3, info.shape, q.data()});
            if (!no_scale)
                entries.push_back({name + "_scale_inv",
                                   DType::F32,
                                   {(rows + 127) / 128, (cols + 127) / 128},
                                   scale.data()});
            continue;
        }
        entries.push_back({name, info.dtype, info.shape, info.data});
    }
    write_safetensors(s.hf + "/model.safetensors", entries);
    return s;
}

std::vector<float> values(const Trainer& t, const ParamInfo& p) {
    const Tensor v = t.plan().view(p.param_slot);
    return std::vector<float>(v.ptr<float>(), v.ptr<float>() + v.numel());
}

}  // namespace

TEST(Pretrained, HfDirectoryStartsAFreshRunFromItsWeights) {
    const std::string dir = test::temp_dir("hf");
    const Source s = make_source(dir);
    Trainer t(two_step_recipe({"load=" + s.hf}), {dir + "/ft", "", Device::CPU});
    Trainer fresh(two_step_recipe(), {dir + "/fresh", "", Device::CPU});
    EXPECT_EQ(t.iteration(), 0);
    EXPECT_EQ(t.pretrained_from(), s.hf);
    SafetensorsFile ckpt(s.ckpt + "/model.safetensors");
    int64_t mtp = 0, loaded = 0;
    for (const auto& p : t.params().params()) {
        const std::vector<float> got = values(t, p);
        if (p.mtp) {
            EXPECT_EQ(got, values(fresh, p)) << p.name << ": the MTP layer keeps its init";
            ++mtp;
            continue;
        }
        const auto& info = ckpt.at(p.name);
        const float* want = reinterpret_cast<const float*>(info.data);
        if (p.name == kFp8Name) {
            // e4m3 times the block scale: exactly, and close to the bf16-trained original.
            const int64_t cols = info.shape[1];
            std::vector<uint8_t> q(got.size());
            std::vector<float> sc(((info.shape[0] + 127) / 128) * ((cols + 127) / 128));
            cpu::quantize_128x128(want, info.shape[0], cols, false, q.data(), sc.data());
            for (size_t i = 0; i < got.size(); ++i)
                ASSERT_EQ(got[i], cpu::e4m3_to_float(q[i]) * sc[0]) << i;
            EXPECT_LT(test::max_rel_error(got, std::vector<float>(want, want + got.size())), 0.07);
        } else {
            EXPECT_EQ(got, std::vector<float>(want, want + got.size())) << p.name;
        }
        ++loaded;
    }
    EXPECT_GT(mtp, 0);
    EXPECT_EQ(int64_t(t.initialized_parameters().size()), mtp);
    EXPECT_GT(loaded, 20);
    const StepMetrics m = t.train_step();
    EXPECT_TRUE(std::isfinite(m.lm_loss));
    EXPECT_EQ(m.step, 1);
}

TEST(Pretrained, MismatchesAndMissingTensorsAreNamed) {
    const std::string dir = test::temp_dir("bad");
    const Source s = make_source(dir, "model.layers.1.post_attention_layernorm.weight");
    std::string msg = test::error_of([&] {
        Trainer(two_step_recipe({"load=" + s.hf}), {dir + "/a", "", Device::CPU});
    });
    EXPECT_NE(msg.find("no tensor 'model.layers.1.post_attention_layernorm.weight'"),
              std::string::npos)
        << msg;
    msg = test::error_of([&] {
        Trainer(two_step_recipe({"load=" + s.hf, "ffn_hidden_size=64"}),
                {dir + "/b", "", Device::CPU});
    });
    EXPECT_NE(msg.find("has ffn_hidden_size 96 but the recipe has 64"), std::string::npos) << msg;
    const Source ns = make_source(test::temp_dir("noscale"), "", /*no_scale=*/true);
    msg = test::error_of([&] {
        Trainer(two_step_recipe({"load=" + ns.hf}), {dir + "/c", "", Device::CPU});
    });
    EXPECT_NE(msg.find(std::string(kFp8Name) + "_scale_inv"), std::string::npos) << msg;
}

// finetune: true makes `load` of an engine checkpoint read its weights only; without it the
// same `load` resumes (iteration 2).
TEST(Pretrained, FinetuneTakesAnEngineCheckpointsWeightsOnly) {
    const std::string dir = test::temp_dir("finetune");
    const Source s = make_source(dir);
    Trainer ft(two_step_recipe({"load=" + s.ckpt, "finetune=true"}),
               {dir + "/ft", "", Device::CPU});
    EXPECT_EQ(ft.iteration(), 0);
    EXPECT_TRUE(ft.initialized_parameters().empty());
    SafetensorsFile ckpt(s.ckpt + "/model.safetensors");
    for (const auto& p : ft.params().params()) {
        const auto& info = ckpt.at(p.name);
        const float* want = reinterpret_cast<const float*>(info.data);
        const auto got = values(ft, p);
        ASSERT_EQ(got, std::vector<float>(want, want + got.size())) << p.name;
    }
    Trainer resumed(two_step_recipe({"load=" + s.ckpt, "train_iters=3"}),
                    {dir + "/r", "", Device::CPU});
    EXPECT_EQ(resumed.iteration(), 2);
    EXPECT_TRUE(resumed.pretrained_from().empty());
}

// From the command line without a recipe: the model comes from config.json (hidden 48 here,
// not the built-in recipe's), the note names what was initialized; --resume of an HF directory
// points to --load.
TEST(Pretrained, CliLoadTakesTheModelFromConfigJson) {
    const std::string dir = test::temp_dir("cli");
    const Source s = make_source(dir);
    auto r = test::run_cli("train --load " + s.hf +
                           " --set train_iters=1 --set seq_length=64 --set global_batch_size=2"
                           " --no-save --out " +
                           dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("hidden 48"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("weights from " + s.hf + " (iteration 0, fresh optimizer state)"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("parameters are not in it and start from their initialization"),
              std::string::npos)
        << r.output;
    auto bad = test::run_cli("train --resume " + s.hf + " --out " + dir + "/out2");
    EXPECT_EQ(bad.code, 1) << bad.output;
    EXPECT_NE(bad.output.find("start from its weights with --load"), std::string::npos)
        << bad.output;
}

// Distinct MTP layers (mtp_use_repeated_layer: false) are HF's next-n layers: the export names
// them model.layers.{L, L+1, L+2} with num_nextn_predict_layers 3, and a run started from it
// takes all three; a recipe with fewer distinct layers is refused (the rest would be dropped), one
// with more initializes only the extra layer.
TEST(Pretrained, DistinctMtpLayersTravelThroughHfAndBack) {
    const std::string dir = test::temp_dir("distinct");
    const std::vector<std::string> distinct = {"mtp_num_layers=3", "mtp_use_repeated_layer=false",
                                               "dsa_mtp_index_kv_share=false"};
    std::string ckpt;
    int64_t L = 0;
    {
        Trainer t(two_step_recipe(distinct), {dir + "/run", "", Device::CPU});
        t.run();
        ckpt = t.checkpoint_dir() + "/iter_0000002";
        L = t.recipe().model.num_layers;
    }
    auto conv = test::run_cli("convert --dtype fp32 --input " + ckpt + " --output " + dir + "/hf");
    ASSERT_EQ(conv.code, 0) << conv.output;
    std::ifstream cfg(dir + "/hf/config.json");
    EXPECT_EQ(nlohmann::json::parse(cfg).at("num_nextn_predict_layers"), 3);
    SafetensorsFile hf(dir + "/hf/model.safetensors");  // one shard at this size
    for (int64_t j = 0; j < 3; ++j)
        EXPECT_TRUE(hf.contains("model.layers." + std::to_string(L + j) + ".eh_proj.weight")) << j;

    auto with = [&](std::vector<std::string> sets) {
        sets.push_back("load=" + dir + "/hf");
        return two_step_recipe(sets);
    };
    Trainer t(with(distinct), {dir + "/a", "", Device::CPU});
    EXPECT_TRUE(t.initialized_parameters().empty());
    SafetensorsFile original(ckpt + "/model.safetensors");
    int64_t mtp = 0;
    for (const auto& p : t.params().params()) {
        const float* want = reinterpret_cast<const float*>(original.at(p.name).data);
        const auto got = values(t, p);
        ASSERT_EQ(got, std::vector<float>(want, want + got.size())) << p.name;
        mtp += p.mtp;
    }
    EXPECT_GT(mtp, 30);
    const std::string msg = test::error_of([&] {
        Trainer(with({}), {dir + "/b", "", Device::CPU});
    });
    EXPECT_NE(msg.find("has 3 distinct MTP layers (num_nextn_predict_layers) but the recipe trains "
                       "1: set mtp_use_repeated_layer: false and mtp_num_layers: 3"),
              std::string::npos)
        << msg;
    Trainer more(
        with({"mtp_num_layers=4", "mtp_use_repeated_layer=false", "dsa_mtp_index_kv_share=false"}),
        {dir + "/c", "", Device::CPU});
    ASSERT_FALSE(more.initialized_parameters().empty());
    for (const std::string& name : more.initialized_parameters())
        EXPECT_EQ(name.rfind("model.layers." + std::to_string(L + 3) + ".", 0), 0u) << name;
}
