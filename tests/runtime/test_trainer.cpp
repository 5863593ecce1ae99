// End to end on CPU: the tiny recipe trains, save -> resume continues bit-identically, eval on a
// checkpoint reproduces the trainer's loss, and bad inputs stop with clear messages.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "indexer_only_check.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/data/split.h"
#include "sparsetron/runtime/evaluate.h"
#include "sparsetron/runtime/run_setup.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

// A smaller model than the demo so the suite stays fast under the sanitizers.
Recipe small_recipe(std::vector<std::string> extra = {}) {
    std::vector<std::string> sets = test::small_model_sets();
    sets.insert(sets.end(), {"global_batch_size=3", "train_iters=6", "lr_warmup_iters=2"});
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_recipe("", sets);
}

using test::error_of;

std::map<std::string, std::vector<char>> snapshot(const std::string& dir) {
    std::map<std::string, std::vector<char>> files;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
        if (!e.is_regular_file()) continue;
        std::ifstream in(e.path(), std::ios::binary);
        files[e.path().string()] = std::vector<char>(std::istreambuf_iterator<char>(in), {});
    }
    return files;
}

}  // namespace

TEST(Trainer, TinyRecipeLossFalls) {
    Recipe r = builtin_tiny_recipe();
    r.run.train_iters = 30;
    Trainer t(r, {test::temp_dir("out"), "", Device::CPU});
    std::vector<double> losses;
    t.run([&](const StepMetrics& m) {
        losses.push_back(m.lm_loss);
        EXPECT_GT(m.tokens, 0);
        EXPECT_TRUE(std::isfinite(m.grad_norm));
    });
    ASSERT_EQ(losses.size(), 30u);
    // Byte-level start: about ln(320) = 5.77. The bound leaves room for thread-count noise.
    EXPECT_GT(losses.front(), 5.5);
    double tail = (losses[27] + losses[28] + losses[29]) / 3;
    EXPECT_LT(tail, 3.3) << "loss did not fall: " << losses.front() << " -> " << tail;
    EXPECT_TRUE(fs::exists(t.checkpoint_dir() + "/iter_0000030/model.safetensors"));
}

void check_bit_identical_resume(const std::vector<std::string>& extra) {
    std::string out = test::temp_dir("a");
    std::vector<std::string> sets = {"save_interval=3", "save_keep_last=5"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    Recipe r = small_recipe(sets);
    std::vector<double> full;
    {
        Trainer t(r, {out, "", Device::CPU});
        t.run([&](const StepMetrics& m) { full.push_back(m.lm_loss); });
    }
    ASSERT_EQ(full.size(), 6u);
    std::string out2 = test::temp_dir("b");
    Trainer resumed(r, {out2, out + "/checkpoints/iter_0000003", Device::CPU});
    EXPECT_EQ(resumed.iteration(), 3);
    std::vector<double> tail;
    resumed.run([&](const StepMetrics& m) { tail.push_back(m.lm_loss); });
    ASSERT_EQ(tail.size(), 3u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(tail[i], full[3 + i]) << "step " << 4 + i;
    // The weights and the optimizer state at the end are identical too.
    for (const char* f : {"/model.safetensors", "/optimizer.safetensors"}) {
        std::string a = out + "/checkpoints/iter_0000006" + f,
                    b = out2 + "/checkpoints/iter_0000006" + f;
        EXPECT_EQ(snapshot(out + "/checkpoints/iter_0000006")[a],
                  snapshot(out2 + "/checkpoints/iter_0000006")[b])
            << f;
    }
}

// fp8_recipe: blockwise on the CPU backend (model/fp8_gemms.h: the CUDA engine's FP8 linears with
// the same quantizers): 6 steps of the small model track the fp32 run (losses within 1%, the first
// gradient norm within 5%: e4m3 perturbs each product by up to 2^-4) and differ from it (the
// linears did run quantized); the loss falls.
TEST(Trainer, Fp8BlockwiseOnCpuTracksFp32) {
    std::vector<StepMetrics> fp32, fp8;
    Trainer(small_recipe(), {test::temp_dir("fp32"), "", Device::CPU})
        .run([&](const StepMetrics& m) { fp32.push_back(m); });
    Trainer(small_recipe({"fp8_recipe=blockwise"}), {test::temp_dir("fp8"), "", Device::CPU})
        .run([&](const StepMetrics& m) { fp8.push_back(m); });
    ASSERT_EQ(fp8.size(), fp32.size());
    bool differs = false;
    for (size_t i = 0; i < fp8.size(); ++i) {
        EXPECT_NEAR(fp8[i].lm_loss, fp32[i].lm_loss, 1e-2 * fp32[i].lm_loss) << "step " << i + 1;
        EXPECT_NEAR(fp8[i].mtp_loss, fp32[i].mtp_loss, 1e-2 * fp32[i].mtp_loss) << "step " << i + 1;
        differs = differs || fp8[i].lm_loss != fp32[i].lm_loss;
    }
    EXPECT_NEAR(fp8[0].grad_norm, fp32[0].grad_norm, 5e-2 * fp32[0].grad_norm);
    EXPECT_NE(fp8[0].grad_norm, fp32[0].grad_norm);
    EXPECT_TRUE(differs) << "the FP8 run reproduced fp32 exactly: its GEMMs did not run";
    EXPECT_LT(fp8.back().lm_loss, fp8.front().lm_loss);
}

TEST(Trainer, ResumeContinuesBitIdentically) {
    check_bit_identical_resume({});
}

TEST(Trainer, ResumeContinuesBitIdenticallyWithMuon) {
    check_bit_identical_resume({"optimizer=muon", "muon_split_qkv_per_head=true",
                                "muon_nesterov=true", "mtp_loss_type=e2e_tv",
                                "mtp_detach_heads=true"});
}

TEST(Trainer, EvalOnACheckpointReproducesTheTrainersLoss) {
    std::string out = test::temp_dir("e");
    Recipe r = small_recipe({"train_iters=3"});
    Trainer t(r, {out, "", Device::CPU});
    t.run();
    // The documents of the next step, one line of token ids each.
    auto batches = t.peek_next_step_batches();
    std::vector<std::vector<int32_t>> docs;
    for (const auto& mb : batches)
        for (int64_t d = 0; d < mb.num_documents; ++d)
            docs.emplace_back(mb.tokens.begin() + mb.cu_seqlens[d],
                              mb.tokens.begin() + mb.cu_seqlens[d + 1]);
    EvalResult e = evaluate(t.checkpoint_dir(), docs);
    StepMetrics next = t.train_step();  // its loss is computed before its update
    EXPECT_EQ(e.targets, next.targets);
    EXPECT_NEAR(e.lm_loss, next.lm_loss, 1e-5 * next.lm_loss);
    // Through the file format the CLI reads, too.
    std::string path = out + "/tokens.txt";
    {
        std::ofstream f(path);
        for (const auto& d : docs) {
            for (size_t i = 0; i < d.size(); ++i) f << (i ? " " : "") << d[i];
            f << "\n";
        }
    }
    EXPECT_EQ(read_token_documents(path), docs);
}

// Validation (split, eval_interval, eval_iters): the held-out part's loss after steps 2 and 4,
// forward only. Training is unchanged by it (bit-identical losses and gradient norms with and
// without), it reads the same documents every time, and its loss equals `eval` of the checkpoint
// on the valid part's documents as the trainer packed them.
TEST(Trainer, ValidationRunsOnTheHeldOutPartWithoutChangingTraining) {
    const std::vector<std::string> split = {"split=80,20,0", "eval_iters=1", "train_iters=4"};
    auto with = split, without = split;
    with.push_back("eval_interval=2");
    without.push_back("eval_interval=0");
    const std::string out = test::temp_dir("valid"), out0 = test::temp_dir("no-valid");
    Trainer t(small_recipe(with), {out, "", Device::CPU});
    std::vector<StepMetrics> steps, plain;
    t.run([&](const StepMetrics& m) { steps.push_back(m); });
    Trainer(small_recipe(without), {out0, "", Device::CPU}).run([&](const StepMetrics& m) {
        plain.push_back(m);
    });
    ASSERT_EQ(steps.size(), 4u);
    ASSERT_EQ(plain.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
        EXPECT_EQ(steps[i].lm_loss, plain[i].lm_loss) << "step " << i + 1;
        EXPECT_EQ(steps[i].grad_norm, plain[i].grad_norm) << "step " << i + 1;
        EXPECT_EQ(steps[i].valid.has_value(), i == 1 || i == 3) << "step " << i + 1;
        EXPECT_FALSE(plain[i].valid.has_value());
    }
    ASSERT_TRUE(steps[3].valid);
    const StepMetrics::Valid v = *steps[3].valid;
    EXPECT_GT(v.targets, 0);
    EXPECT_EQ(v.micro_batches, 3);
    EXPECT_TRUE(std::isfinite(v.lm_loss));
    EXPECT_NE(v.lm_loss, steps[1].valid->lm_loss) << "the weights changed between steps 2 and 4";
    auto again = t.validate();
    ASSERT_TRUE(again);
    EXPECT_EQ(again->lm_loss, v.lm_loss) << "validation must read the same documents each time";
    // The valid part's micro-batches as the trainer packs them, evaluated from the checkpoint.
    const Recipe& r = t.recipe();
    DocumentStream valid(resolve_data_path(r.run, out), uint64_t(r.run.seed), DataPart::Valid,
                         parse_split(r.run.split));
    const int64_t slots = r.run.tokens_per_microbatch();
    Packer packer(valid, slots, default_max_documents(slots));
    std::vector<std::vector<int32_t>> docs;
    for (int i = 0; i < 3; ++i) {
        MicroBatch mb(slots, default_max_documents(slots));
        packer.next(mb);
        for (int64_t d = 0; d < mb.num_documents; ++d)
            docs.emplace_back(mb.tokens.begin() + mb.cu_seqlens[d],
                              mb.tokens.begin() + mb.cu_seqlens[d + 1]);
    }
    const EvalResult e = evaluate(t.checkpoint_dir(), docs, &r.model);
    EXPECT_EQ(e.targets, v.targets);
    EXPECT_NEAR(e.lm_loss, v.lm_loss, 1e-5 * v.lm_loss);
    EXPECT_GT(v.mtp_loss, 0);
    EXPECT_NEAR(e.mtp_loss, v.mtp_loss, 1e-5 * v.mtp_loss);
    // The training part never holds a valid document: different documents, different loss.
    EXPECT_NE(e.lm_loss, steps[3].lm_loss);
}

TEST(Trainer, KeepsTheNewestCheckpoints) {
    std::string out = test::temp_dir("k");
    Trainer t(small_recipe({"save_interval=1", "save_keep_last=2", "train_iters=4"}),
              {out, "", Device::CPU});
    t.run();
    std::vector<std::string> dirs;
    for (const auto& e : fs::directory_iterator(out + "/checkpoints"))
        if (e.path().filename().string()[0] != '.') dirs.push_back(e.path().filename());
    std::sort(dirs.begin(), dirs.end());
    EXPECT_EQ(dirs, (std::vector<std::string>{"iter_0000003", "iter_0000004",
                                              "latest_checkpointed_iteration.txt"}));
    EXPECT_EQ(resolve_checkpoint(out + "/checkpoints"), out + "/checkpoints/iter_0000004");
}

TEST(Trainer, MismatchedCheckpointFailsAndIsNotDamaged) {
    std::string out = test::temp_dir("m");
    { Trainer(small_recipe({"train_iters=1"}), {out, "", Device::CPU}).run(); }
    auto before = snapshot(out + "/checkpoints");
    std::string msg = error_of([&] {
        Trainer(small_recipe({"ffn_hidden_size=64"}), {out, out + "/checkpoints", Device::CPU});
    });
    EXPECT_NE(msg.find("model.layers.0.mlp.gate_proj.weight' has shape [96, 48]"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("expects [64, 48]"), std::string::npos) << msg;
    EXPECT_EQ(snapshot(out + "/checkpoints"), before);
    msg = error_of([&] { Trainer(small_recipe(), {out, out + "/nothing-here", Device::CPU}); });
    EXPECT_NE(msg.find("nothing-here' does not exist"), std::string::npos) << msg;
}

TEST(Trainer, BadDataAndOutputStopWithClearMessages) {
    std::string dir = test::temp_dir("d");
    std::ofstream(dir + "/file") << "x";
    std::string msg = error_of([&] {
        Trainer(small_recipe(), {dir + "/file/sub", "", Device::CPU});
    });
    EXPECT_NE(msg.find("cannot create output directory '" + dir + "/file/sub'"), std::string::npos)
        << msg;
    msg = error_of([&] {
        Trainer(small_recipe({"data_path=" + dir + "/missing"}), {dir, "", Device::CPU});
    });
    EXPECT_NE(msg.find(dir + "/missing.idx"), std::string::npos) << msg;
    msg = error_of([&] { Trainer(small_recipe({"vocab_size=200"}), {dir, "", Device::CPU}); });
    EXPECT_NE(msg.find("token id 256 but vocab_size is 200"), std::string::npos) << msg;
    msg = error_of([&] { Trainer(small_recipe(), {dir, "", Device::CUDA}); });
    EXPECT_NE(msg.find("--device cuda"), std::string::npos) << msg;
    // FP8 recipes never train in higher precision silently: mxfp8 points to the Hopper recipe,
    // the FP8 head needs CUDA, tensorwise is not implemented.
    msg = error_of([&] { Trainer(small_recipe({"fp8_recipe=mxfp8"}), {dir, "", Device::CPU}); });
    EXPECT_NE(msg.find("On Hopper add the overlay recipes/overlays/h200.yaml"), std::string::npos)
        << msg;
    msg = error_of([&] {
        Trainer(small_recipe({"fp8_recipe=blockwise", "fp8_output_proj=true"}),
                {dir, "", Device::CPU});
    });
    EXPECT_NE(msg.find("fp8_output_proj (the head's GEMMs in FP8) runs on CUDA only"),
              std::string::npos)
        << msg;
    msg = error_of([&] {
        Trainer(small_recipe({"fp8_recipe=tensorwise"}), {dir, "", Device::CPU});
    });
    EXPECT_NE(msg.find("fp8_recipe: tensorwise is not implemented"), std::string::npos) << msg;
    // fp8_format only matters under an FP8 recipe: a bf16 run with it set gets past the check
    // (to the next one: this test's CUDA device is not there).
    msg = error_of([&] { Trainer(small_recipe({"fp8_format=hybrid"}), {dir, "", Device::CUDA}); });
    EXPECT_EQ(msg.find("fp8_format"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--device cuda"), std::string::npos) << msg;
    // 2 layers + MTP layer 3 with freq 2: offset 1 makes the MTP layer full, offset 2 shared (it
    // attends over layer 2's top-k); kv sharing across the depths is accepted in both.
    std::vector<std::string> dsa = {"experimental_attention_variant=dsa",
                                    "dsa_indexer_n_heads=2",
                                    "dsa_indexer_head_dim=16",
                                    "dsa_indexer_topk=8",
                                    "mtp_num_layers=2",
                                    "dsa_mtp_index_kv_share=true",
                                    "dsa_indexer_topk_freq=2"};
    auto with = [&](std::vector<std::string> v, const std::string& extra) {
        v.push_back(extra);
        return v;
    };
    EXPECT_EQ(error_of([&] { small_recipe(with(dsa, "dsa_indexer_skip_topk_offset=1")); }), "");
    EXPECT_EQ(error_of([&] { small_recipe(with(dsa, "dsa_indexer_skip_topk_offset=2")); }), "");
}

TEST(Trainer, DenseWarmupTrainsOnlyTheIndexerAndItsLossFalls) {
    // SPEC §3.2: attention over all keys, backbone frozen, the indexer learns the attention's
    // distribution: its loss must fall and nothing else may move.
    std::string out = test::temp_dir("w");
    Recipe r = small_recipe({"dsa_dense_warmup=true", "train_iters=25", "lr=1e-2",
                             "lr_warmup_iters=0", "min_lr=1e-2", "dsa_indexer_loss_coeff=1"});
    Trainer t(r, {out, "", Device::CPU});
    const auto before = test::parameter_values(t);
    std::vector<double> losses;
    t.run([&](const StepMetrics& m) { losses.push_back(m.indexer_loss); });
    EXPECT_LT((losses[22] + losses[23] + losses[24]) / 3,
              0.7 * (losses[0] + losses[1] + losses[2]) / 3)
        << losses.front() << " -> " << losses.back();
    test::expect_only_indexers_moved(t, before);
}

// The indexer loss is logged on Megatron's scale (its sum over layers divided by num_layers)
// while the objective adds the sum: total_loss - lm - mtp - aux is num_layers times the logged
// value (2 layers here), and the logged value is positive.
TEST(Trainer, IndexerLossIsLoggedOnMegatronsScale) {
    Recipe r = small_recipe({"train_iters=2", "dsa_indexer_loss_coeff=1"});
    ASSERT_EQ(r.model.num_layers, 2);
    Trainer t(r, {test::temp_dir("indexer-scale"), "", Device::CPU});
    t.run([&](const StepMetrics& m) {
        EXPECT_GT(m.indexer_loss, 0);
        EXPECT_NEAR(m.total_loss - m.lm_loss - m.mtp_loss - m.aux_loss, 2 * m.indexer_loss,
                    1e-9 * m.total_loss)
            << "step " << m.step;
        // Per layer: the layers computing an indexer (the tiny model's layer 0, whose top-k
        // layer 1 shares, and MTP depth 1's layer as layer 2), positive, summing to the logged
        // loss times num_layers.
        double sum = 0;
        std::vector<int64_t> layers;
        for (const auto& [layer, loss] : m.indexer_loss_layers) {
            EXPECT_GT(loss, 0) << "layer " << layer;
            sum += loss;
            layers.push_back(layer);
        }
        EXPECT_EQ(layers, (std::vector<int64_t>{0, 2})) << "step " << m.step;
        EXPECT_NEAR(sum, 2 * m.indexer_loss, 1e-12 * sum);
        const auto j = nlohmann::json::parse(m.to_json());
        EXPECT_EQ(j["indexer_loss_per_layer"].size(), 2u);
        EXPECT_EQ(j["indexer_loss_per_layer"]["2"].get<double>(), m.indexer_loss_layers[1].second);
    });
}
