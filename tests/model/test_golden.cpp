// Parity with HuggingFace transformers' glm_moe_dsa (fixtures from tools/golden/make_fixtures.py):
// the CPU engine loads each fixture by its HF parameter names and reproduces HF's per-document
// losses within 1e-5 relative and its logits within 1e-4, with all documents packed into one
// THD micro-batch (they must not see each other) and each document alone.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/safetensors.h"
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/runtime/evaluate.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

std::string fixture(const std::string& name) {
    return std::string(SPARSETRON_SOURCE_DIR) + "/tests/fixtures/golden/" + name;
}

void check_fixture(const std::string& name) {
    const std::string dir = fixture(name);
    ModelConfig cfg = load_hf_config(dir + "/config.json");
    auto docs = read_token_documents(dir + "/documents.txt");
    nlohmann::json expected;
    std::ifstream(dir + "/expected.json") >> expected;
    ASSERT_EQ(expected["documents"].size(), docs.size());

    const int64_t slots = 64, max_docs = 4;
    MemoryPlan plan;
    Glm5Model<double> model(cfg, plan, slots, max_docs, 32);
    plan.allocate(Device::CPU);
    model.bind();
    load_model_weights(dir, model.params(), plan);
    std::vector<double> logits(cfg.vocab_size);

    // All documents packed together.
    MicroBatch packed(slots, max_docs);
    for (const auto& d : docs) ASSERT_TRUE(packed.add_document(d));
    model.load_inputs(packed);
    LossSums all = model.forward_backward(0.0, false);
    double expect_sum = 0;
    int64_t expect_count = 0;
    for (const auto& d : expected["documents"]) {
        expect_sum += d["ce_sum"].get<double>();
        expect_count += d["targets"].get<int64_t>();
    }
    EXPECT_EQ(all.lm_targets, expect_count);
    const double mean = all.lm_loss_sum / double(all.lm_targets);
    EXPECT_NEAR(mean, expected["mean_loss"].get<double>(), 1e-5 * std::fabs(mean)) << name;
    for (size_t d = 0; d < docs.size(); ++d) {
        const auto& e = expected["documents"][d];
        auto rows = e["logits_rows"].get<std::vector<int64_t>>();
        for (size_t r = 0; r < rows.size(); ++r) {
            model.logits_row(packed.cu_seqlens[d] + rows[r], logits.data());
            auto want = e["logits"][r].get<std::vector<double>>();
            for (size_t v = 0; v < want.size(); ++v)
                EXPECT_NEAR(logits[v], want[v], 1e-4) << name << " doc " << d << " row " << rows[r];
        }
    }
    // Each document alone gives HF's per-document loss.
    for (size_t d = 0; d < docs.size(); ++d) {
        MicroBatch one(slots, max_docs);
        one.add_document(docs[d]);
        model.load_inputs(one);
        LossSums s = model.forward_backward(0.0, false);
        const double want = expected["documents"][d]["ce_sum"].get<double>();
        EXPECT_NEAR(s.lm_loss_sum, want, 1e-5 * std::fabs(want)) << name << " doc " << d;
    }
    // And through `sparsetron eval`'s path.
    EvalResult ev = evaluate(dir, docs);
    EXPECT_NEAR(ev.lm_loss, expected["mean_loss"].get<double>(), 1e-5 * ev.lm_loss);
}

}  // namespace

TEST(GoldenHf, MoeDsaWithIndexShare) {
    check_fixture("moe_dsa_share");
}
TEST(GoldenHf, IndexShareFromFreqAndOffset) {
    check_fixture("freq_offset");
}
TEST(GoldenHf, DenseLayersTopkCoversDocuments) {
    check_fixture("dense_topk_covers");
}

TEST(GoldenHf, ShardedCheckpointLoadsLikeTheSingleFile) {
    // Split a fixture's weights into two shards with an HF index and evaluate that directory.
    const std::string src = fixture("moe_dsa_share");
    const std::string dir = test::temp_dir("sharded");
    std::filesystem::copy_file(src + "/config.json", dir + "/config.json");
    SafetensorsFile file(src + "/model.safetensors");
    std::vector<SafetensorsEntry> a, b;
    nlohmann::json map;
    int i = 0;
    for (const auto& [name, info] : file.tensors()) {
        bool first = i++ % 2 == 0;
        (first ? a : b).push_back({name, info.dtype, info.shape, info.data});
        map[name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
    write_safetensors(dir + "/model-00001-of-00002.safetensors", a);
    write_safetensors(dir + "/model-00002-of-00002.safetensors", b);
    std::ofstream(dir + "/model.safetensors.index.json")
        << nlohmann::json{{"weight_map", map}}.dump();
    auto docs = read_token_documents(src + "/documents.txt");
    EXPECT_DOUBLE_EQ(evaluate(dir, docs).lm_loss, evaluate(src, docs).lm_loss);
}
