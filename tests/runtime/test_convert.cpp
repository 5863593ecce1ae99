// `sparsetron convert`: an engine checkpoint becomes an HF directory of bf16 shards with its
// index, config.json and generation_config.json, which `eval` scores like the checkpoint (bf16
// rounding apart); converted back it holds exactly the bf16-rounded weights and trains. The
// transformers side (from_pretrained on the export) runs on the GPU machine
// (tools/golden/check_export.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/io/safetensors.h"
#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

double eval_loss(const std::string& model, const std::string& tokens) {
    auto r = test::run_cli("eval --json --model " + model + " --tokens " + tokens);
    EXPECT_EQ(r.code, 0) << r.output;
    return r.code == 0 ? nlohmann::json::parse(r.output).at("lm_loss").get<double>() : -1;
}
}  // namespace

TEST(Convert, EngineToHfShardsAndBack) {
    const std::string dir = test::temp_dir("convert");
    auto train =
        test::run_cli("train --set train_iters=2 --out " + dir + "/run" + test::small_run_cli());
    ASSERT_EQ(train.code, 0) << train.output;
    const std::string ckpt = dir + "/run/checkpoints";
    // Shards of at most 64 KiB: several files, each tensor in exactly one.
    auto to_hf = test::run_cli("convert --input " + ckpt + " --output " + dir +
                               "/hf --shard-size-gib 0.00006");
    ASSERT_EQ(to_hf.code, 0) << to_hf.output;
    for (const char* f : {"config.json", "generation_config.json", "model.safetensors.index.json"})
        EXPECT_TRUE(fs::exists(dir + "/hf/" + f)) << f;
    std::ifstream idx(dir + "/hf/model.safetensors.index.json");
    const auto index = nlohmann::json::parse(idx);
    std::set<std::string> files;
    for (const auto& [name, file] : index.at("weight_map").items())
        files.insert(file.get<std::string>());
    EXPECT_GT(files.size(), 2u);
    SafetensorsFile original(dir + "/run/checkpoints/iter_0000002/model.safetensors");
    EXPECT_EQ(index.at("weight_map").size(), original.tensors().size());
    int64_t total = 0;
    for (const std::string& f : files) {
        SafetensorsFile shard(dir + "/hf/" + f);
        EXPECT_EQ(shard.metadata().at("format"), "pt") << f;
        for (const auto& [name, info] : shard.tensors()) {
            EXPECT_EQ(info.dtype, DType::BF16) << name;
            EXPECT_EQ(index.at("weight_map").at(name), f) << name;
            total += int64_t(info.bytes);
        }
    }
    EXPECT_EQ(index.at("metadata").at("total_size").get<int64_t>(), total);
    // The same documents score within bf16 rounding of the weights.
    const std::string tokens = dir + "/tokens.txt";
    std::ofstream(tokens) << "5 17 99 3 250 41 7 7 12 300 2 64 65 66\n8 9 10 11 200 201 5\n";
    const double a = eval_loss(ckpt, tokens), b = eval_loss(dir + "/hf", tokens);
    EXPECT_NEAR(b, a, 2e-2 * a);
    // Back to the engine's form: fp32, exactly the bf16-rounded weights; training starts from it.
    auto back =
        test::run_cli("convert --to engine --input " + dir + "/hf --output " + dir + "/back");
    ASSERT_EQ(back.code, 0) << back.output;
    SafetensorsFile round(dir + "/back/model.safetensors");
    for (const auto& [name, info] : original.tensors()) {
        ASSERT_TRUE(round.contains(name)) << name;
        const auto& r = round.at(name);
        ASSERT_EQ(r.dtype, DType::F32);
        const float* x = reinterpret_cast<const float*>(info.data);
        const float* y = reinterpret_cast<const float*>(r.data);
        for (size_t i = 0; i < info.bytes / 4; ++i)
            ASSERT_EQ(y[i], bf16_to_float(float_to_bf16(x[i]))) << name << " " << i;
    }
    EXPECT_NEAR(eval_loss(dir + "/back", tokens), b, 1e-6 * b);
    auto ft = test::run_cli("train --load " + dir + "/back --set train_iters=1 --no-save --out " +
                            dir + "/ft --set seq_length=64 --set global_batch_size=2 -q");
    EXPECT_EQ(ft.code, 0) << ft.output;
    // An output that already holds weights is refused.
    auto again = test::run_cli("convert --input " + ckpt + " --output " + dir + "/hf");
    EXPECT_EQ(again.code, 1);
    EXPECT_NE(again.output.find("already holds weights"), std::string::npos) << again.output;
}
