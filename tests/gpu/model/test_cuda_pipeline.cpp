// Pipeline parallelism on CUDA (runtime/cuda/cuda_pipeline.h) on one GPU: the stages of a
// pipeline as threads, each with its own engine (its own stream and plan), joined by a
// communicator whose transfers copy between the threads' device buffers. Two steps of the tiny
// recipe split over two stages (layer 0 with the embedding | layer 1, both computing their own
// indexer, the head and MTP with the embedding's copy) against the whole model on one engine:
// losses, gradient norms and weights.
// Over NCCL between two GPUs: the same schedule, its transfers grouped send/recv
// (parallel/nccl/nccl_comm.cpp).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu/harness.h"
#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/config/recipe.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/runtime/step_engine.h"
#include "sparsetron/runtime/trainer.h"

#if SPARSETRON_WITH_CUDA
#include "gpu/thread_training.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaPipeline, Skipped) {
    GTEST_SKIP() << "built without CUDA: GPU tests run on the GPU machine";
}
#else

namespace {

// The tiny recipe's top-k below its micro-batch (the sparse path) and eager steps; offset 2
// makes both layers full, so each of two stages starts on one (Megatron's rule).
Recipe pipeline_recipe() {
    Recipe r = builtin_tiny_recipe();
    r.model.dsa_indexer_topk = 128;
    r.model.dsa_indexer_skip_topk_offset = 2;
    r.run.cuda_graph_impl = "none";
    return r;
}

struct EngineRun {
    std::vector<StepOutcome> steps;
    std::map<std::string, std::vector<float>> weights;  // by name, after the last step
    int64_t recomputed = 0;
};

// Two steps of `mbs` on an engine of `stage` (its own host plan, initialized by name from one
// seed: every layout starts from the same weights).
EngineRun run_engine(const Recipe& r, const PipelineStage& stage,
                     const std::vector<std::vector<const MicroBatch*>>& steps, const LossScales& sc,
                     Comm* pp = nullptr, Comm* embedding = nullptr) {
    auto tp = make_training_plan(r, Device::CUDA, stage);
    tp->plan.allocate_only(Device::CPU, {MemClass::Parameters, MemClass::OptimizerState});
    tp->params->initialize(tp->plan, 5, r.model.init_method_std, r.model.num_layers);
    Communicators comms;
    comms.pipeline = pp, comms.embedding = embedding;
    auto engine = make_cuda_engine(r, *tp, comms);
    engine->upload_state();
    EngineRun out;
    for (size_t s = 0; s < steps.size(); ++s) {
        out.steps.push_back(engine->run_step({steps[s], {}, sc, int64_t(s) + 1}));
        out.recomputed += engine->bench()->pipeline_recomputed();
    }
    engine->download_state();
    for (const auto& p : tp->params->params()) {
        std::vector<float> w(size_t(p.numel()));
        std::memcpy(w.data(), tp->plan.view(p.param_slot).data, w.size() * sizeof(float));
        out.weights[p.name] = std::move(w);
    }
    return out;
}

}  // namespace

TEST(CudaPipeline, TwoStagesMatchOneGpuOverTwoSteps) {
    REQUIRE_GPU();
    const Recipe whole = pipeline_recipe();
    Recipe r = whole;
    r.run.pipeline_model_parallel_size = 2;
    r.run.world_size = 2;
    // Three micro-batches per step: stage 0 runs a warm-up forward, two steady 1F1B pairs and
    // a drained backward.
    const int64_t slots = r.run.tokens_per_microbatch(), n = 3;
    auto plan = make_training_plan(whole, Device::CUDA);
    std::vector<std::unique_ptr<MicroBatch>> own;
    std::vector<std::vector<const MicroBatch*>> steps(2);
    CounterRng rng(31, 7);
    uint64_t draw = 0;
    int64_t targets = 0;
    for (auto& step : steps)
        for (int64_t i = 0; i < n; ++i) {
            own.push_back(std::make_unique<MicroBatch>(slots, plan->max_documents));
            for (int d = 0; d < 2; ++d) {
                std::vector<int32_t> doc(size_t(slots / 2 - 9 * (draw % 4) - d));
                for (auto& t : doc) t = int32_t(rng.bits(draw++) % uint64_t(r.model.vocab_size));
                ASSERT_TRUE(own.back()->add_document(doc));
            }
            targets = std::max(targets, own.back()->num_targets());
            step.push_back(own.back().get());
        }
    LossScales sc;
    sc.backward = true;
    sc.lm = 1.0 / double(n * targets);
    sc.mtp.assign(size_t(r.model.mtp_num_layers), 0.1 / double(n * targets));
    sc.indexer = sc.aux = 1.0 / double(n);

    const EngineRun ref = run_engine(whole, {}, steps, sc);
    auto pp_group = std::make_shared<ThreadGroup>(2);
    auto embedding_group = std::make_shared<ThreadGroup>(2, pp_group->job);
    std::vector<EngineRun> stage(2);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int s = 0; s < 2; ++s)
        threads.emplace_back([&, s] {
            try {
                ThreadComm pp(pp_group, s), embedding(embedding_group, s);
                stage[size_t(s)] =
                    run_engine(r, pipeline_stage(r.model, r.run, s), steps, sc, &pp, &embedding);
            } catch (const std::exception& e) {
                errors[size_t(s)] = e.what();
                pp_group->fail();  // the other stage stops waiting for this one
            }
        });
    for (auto& t : threads) t.join();
    ASSERT_EQ(errors[0], "") << "stage 0";
    ASSERT_EQ(errors[1], "") << "stage 1";

    // Stage 0 runs every micro-batch's forward again before its backward (another forward ran
    // in between); the last stage runs each backward right after its forward.
    EXPECT_EQ(stage[0].recomputed, 2 * n);
    EXPECT_EQ(stage[1].recomputed, 0);
    for (size_t s = 0; s < steps.size(); ++s) {
        const auto &a = stage[0].steps[s], &b = stage[1].steps[s], &w = ref.steps[s];
        ASSERT_EQ(a.losses.size(), size_t(n));
        ASSERT_EQ(b.losses.size(), size_t(n));
        // Chained steps: Adam turns last-bit differences of fp32 sums into weight differences
        // (the tolerance of CudaTraining.FullIterationGraphMatchesEagerAndRecaptures).
        const double tol = s == 0 ? 1e-5 : 1e-4;
        for (size_t i = 0; i < size_t(n); ++i) {
            EXPECT_EQ(a.losses[i].lm_targets, 0) << "the head is on the last stage";
            EXPECT_EQ(b.losses[i].lm_targets, w.losses[i].lm_targets);
            EXPECT_NEAR(b.losses[i].lm_loss_sum, w.losses[i].lm_loss_sum,
                        tol * w.losses[i].lm_loss_sum);
            ASSERT_EQ(b.losses[i].mtp_sum.size(), w.losses[i].mtp_sum.size());
            for (size_t k = 0; k < w.losses[i].mtp_sum.size(); ++k)
                EXPECT_NEAR(b.losses[i].mtp_sum[k], w.losses[i].mtp_sum[k],
                            tol * w.losses[i].mtp_sum[k]);
            // The indexer's layer 0 on stage 0, MTP's indexer on stage 1.
            EXPECT_GT(a.losses[i].indexer_loss, 0);
            EXPECT_NEAR(a.losses[i].indexer_loss + b.losses[i].indexer_loss,
                        w.losses[i].indexer_loss, 10 * tol * w.losses[i].indexer_loss);
        }
        std::cout << "[pipeline] step " << s + 1 << ": lm " << b.losses[0].lm_loss_sum << " vs "
                  << w.losses[0].lm_loss_sum << ", grad_norm " << a.stats.grad_norm << " / "
                  << b.stats.grad_norm << " vs " << w.stats.grad_norm << "\n";
        // The clipping norm is the whole model's on every stage.
        EXPECT_EQ(a.stats.grad_norm, b.stats.grad_norm);
        EXPECT_NEAR(a.stats.grad_norm, w.stats.grad_norm, 10 * tol * w.stats.grad_norm);
        EXPECT_FALSE(a.stats.skipped);
    }
    // Every stage's weights against the whole model's; the embedding's two copies alike.
    std::vector<float> got, want;
    for (const EngineRun& st : stage)
        for (const auto& [name, w] : st.weights) {
            ASSERT_TRUE(ref.weights.count(name)) << name;
            got.insert(got.end(), w.begin(), w.end());
            const auto& rw = ref.weights.at(name);
            want.insert(want.end(), rw.begin(), rw.end());
        }
    size_t ref_values = 0;
    for (const auto& [name, w] : ref.weights) ref_values += w.size();
    EXPECT_EQ(got.size(), ref_values + ref.weights.at("model.embed_tokens.weight").size())
        << "the stages hold every parameter once, the embedding twice";
    expect_close("weights after two steps, two stages vs one GPU", got, want, 1e-4);
    EXPECT_EQ(stage[0].weights.at("model.embed_tokens.weight"),
              stage[1].weights.at("model.embed_tokens.weight"));
}

// The trainer's pipeline path on CUDA, two stages as two threads of one process on one GPU
// (each rank's trainer, engine and stream; every collective and transfer through the host):
// the stages' losses, routing statistics and gradient norm joined into one step's metrics, the
// validation's forward through the stages, and the checkpoint the stages write (a shard each)
// resumed by one GPU. Equal to one GPU running the whole model.
TEST(CudaPipeline, TrainerTwoStagesMatchOneGpuAndResumeOnOneGpu) {
    REQUIRE_GPU();
    const std::string one_dir = temp_dir("one"), ckpt_dir = temp_dir("checkpoints");
    // Offset 2: both layers full, so the second stage starts on one (Megatron's rule).
    const std::string full_layers = "dsa_indexer_skip_topk_offset=2";
    const auto one =
        train(trainer_recipe(1, {full_layers}), {one_dir, "", Device::CUDA, false, nullptr});
    ASSERT_EQ(one.size(), 4u);

    const auto got = train_threads(2,
                                   trainer_recipe(2, {full_layers, "pipeline_model_parallel_size=2",
                                                      "save_interval=2", "save=" + ckpt_dir}),
                                   "pp2", true);
    expect_metrics_match("pipeline trainer", one, got, 1e-5, true);
    ASSERT_TRUE(one[1].valid.has_value()) << "validation ran at step 2";

    // The stages' checkpoint at step 2 (a shard per stage) on one GPU: steps 3 and 4 again.
    const std::string ckpt = ckpt_dir + "/iter_0000002";
    ASSERT_TRUE(std::filesystem::exists(ckpt + "/model.safetensors.index.json"));
    const auto resumed = train(trainer_recipe(1, {full_layers, "pipeline_model_parallel_size=1"}),
                               {temp_dir("resumed"), ckpt, Device::CUDA, false, nullptr});
    ASSERT_EQ(resumed.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
        std::cout << "[pipeline checkpoint -> 1 GPU] step " << i + 3 << ": lm "
                  << resumed[i].lm_loss << " vs " << one[i + 2].lm_loss << "\n";
        EXPECT_EQ(resumed[i].step, one[i + 2].step);
        EXPECT_NEAR(resumed[i].lm_loss, one[i + 2].lm_loss, 1e-4 * one[i + 2].lm_loss);
        EXPECT_NEAR(resumed[i].grad_norm, one[i + 2].grad_norm, 1e-2 * one[i + 2].grad_norm);
    }
}

// Pipeline stages combined with the other layouts on CUDA, four trainers as threads on one GPU,
// each equal to one GPU running the whole model: PP 2 x DP 2 (a 1 + 3 layer split, the IndexShare
// layer 2 reading layer 1's top-k on the second stage, Muon under the distributed optimizer, each
// stage's two ranks taking half of the micro-batches); PP 2 x EP 2 (each stage's experts over its
// two ranks, the exchange in its NCCL form: all-to-all of fixed blocks); PP 2 x CP 2 (each
// stage's documents split over its two ranks, keys gathered; the dense indexer loss); PP 2 x
// dynamic CP 2 (each stage's micro-batches grouped per step, the same groups on both stages, so
// a boundary's rows follow the same CP sharding; per-token loss, no validation: it does not run
// under dynamic CP; the multi-GPU dynamic-CP tolerance of 1e-3 on step 1's gradient norm, and
// 3e-5 on its losses: each group's GEMMs run over other row counts than one GPU's, so a router
// score rounds across a tie and a row takes another expert, which the test prints).
// Offset 2 starts every stage on a full layer (Megatron's rule).
TEST(CudaPipeline, TrainerStagesTimesDataExpertContextParallelMatchOneGpu) {
    REQUIRE_GPU();
    struct Case {
        std::string tag;
        std::vector<std::string> model, layout;
        bool loads_equal;
        double grad_norm_tol = 0, step1_tol = 1e-5;
    };
    const std::vector<Case> cases = {
        {"pp2xdp2",
         {"num_layers=4", "moe_layer_freq=[0,1,1,1]", "optimizer=muon",
          "use_distributed_optimizer=true", "dsa_indexer_skip_topk_offset=2"},
         {"pipeline_model_parallel_size=2", "decoder_first_pipeline_num_layers=1"},
         true},
        {"pp2xep2",
         {"dsa_indexer_skip_topk_offset=2"},
         {"pipeline_model_parallel_size=2", "expert_model_parallel_size=2",
          "moe_expert_exchange=nccl"},
         true},
        // The dense indexer loss: one GPU then runs the absorbed attention, as CP does (with the
        // sparse loss it would take the expanded form, rounding differently).
        {"pp2xcp2",
         {"dsa_indexer_use_sparse_loss=false", "dsa_indexer_skip_topk_offset=2"},
         {"pipeline_model_parallel_size=2", "context_parallel_size=2"},
         false},
        {"pp2xdcp2",
         {"dsa_indexer_use_sparse_loss=false", "dsa_indexer_skip_topk_offset=2",
          "calculate_per_token_loss=true", "eval_interval=0"},
         {"pipeline_model_parallel_size=2", "context_parallel_size=2",
          "dynamic_context_parallel=true", "sequence_packing_scheduler=default_dynamic_cp",
          "max_seqlen_per_dp_cp_rank=160"},
         false,
         1e-3,
         3e-5},
    };
    for (const Case& c : cases) {
        const auto one = train(trainer_recipe(1, c.model),
                               {temp_dir(c.tag + "-one"), "", Device::CUDA, false, nullptr});
        ASSERT_EQ(one.size(), 4u);
        std::vector<std::string> sets = c.model;
        sets.insert(sets.end(), c.layout.begin(), c.layout.end());
        const auto ranks = train_threads(4, trainer_recipe(4, sets), c.tag);
        expect_metrics_match(c.tag, one, ranks, c.step1_tol, c.loads_equal, c.grad_norm_tol);
        if (c.tag == "pp2xdcp2") {
            int64_t pairs = 0;
            for (const StepMetrics& m : ranks[0])
                if (m.dynamic_cp_groups.size() > 1) pairs += m.dynamic_cp_groups[1];
            std::cout << "[pp2xdcp2] groups of two ranks over the run: " << pairs << "\n";
            EXPECT_GT(pairs, 0) << "no group of two ranks ran";
        }
    }
}

// The paged stash and activation offload under pipeline parallelism, two stages as threads on one
// GPU against one GPU without either. A stage's forwards that its 1F1B schedule runs again
// before their backward keep nothing (no stash pages, nothing offloaded); the forward run again
// keeps them for the backward that follows. With a pool too small for any step (factor 0.3) one
// stage's overflow redoes the step eagerly on both stages (the first holds no MoE layer, so no
// stash: the overflow reaches it through the world's flag), and the losses are still one GPU's.
TEST(CudaPipeline, TrainerStagesWithTheStashAndOffloadMatchOneGpu) {
    REQUIRE_GPU();
    // Four layers, three of them MoE, split 2 + 2 (1 + 3 for the overflow). Offset 3: layers 1-3
    // compute their own indexer, the fourth shares the third's, so every stage starts on a
    // layer that computes one (as Megatron's split check asks).
    const std::vector<std::string> model = {"num_layers=4", "moe_layer_freq=[0,1,1,1]",
                                            "dsa_indexer_skip_topk_offset=3"};
    const auto one =
        train(trainer_recipe(1, model), {temp_dir("one"), "", Device::CUDA, false, nullptr});
    ASSERT_EQ(one.size(), 4u);
    struct Case {
        std::string tag;
        std::vector<std::string> sets;
        int64_t redos;
    };
    const std::vector<Case> cases = {
        {"pp2-stash", {"moe_paged_stash=true"}, 0},
        {"pp2-stash-overflow",
         {"moe_paged_stash=true", "moe_paged_stash_buffer_size_factor_cuda=0.3",
          "decoder_first_pipeline_num_layers=1"},
         4},
        {"pp2-offload",
         {"fine_grained_activation_offloading=true",
          "offload_modules=[attn_norm,mlp_norm,qkv_linear,core_attn,attn_proj,expert_fc1,moe_act]"},
         0},
    };
    for (const Case& c : cases) {
        std::vector<std::string> sets = model;
        sets.push_back("pipeline_model_parallel_size=2");
        sets.insert(sets.end(), c.sets.begin(), c.sets.end());
        const auto ranks = train_threads(2, trainer_recipe(2, sets), c.tag);
        expect_metrics_match(c.tag, one, ranks, 1e-5, true);
        for (size_t r = 0; r < ranks.size(); ++r) {
            ASSERT_EQ(ranks[r].size(), one.size()) << c.tag;
            EXPECT_EQ(ranks[r].back().moe_stash_redos, c.redos) << c.tag << " rank " << r;
            for (const StepMetrics& m : ranks[r]) EXPECT_FALSE(m.skipped) << c.tag;
        }
    }
}

// Interleaved (virtual) pipeline stages on CUDA: two pipeline ranks of two chunks each (stages
// 0-3, a layer each: rank 0 holds layers 0 and 2 with the embedding, rank 1 layers 1 and 3 with
// the head and MTP) as threads on one GPU, against one GPU running the whole model: eagerly,
// with the paged stash, and with dynamic CP 2 on each pipeline rank (four threads; the
// tolerances of the pp2xdcp2 case above). Every layer computes its own indexer, so every stage
// starts on one (Megatron's rule). The threads' transfers synchronize, so the captured graph is
// the two-GPU test's (test_multigpu).
TEST(CudaPipeline, TrainerInterleavedStagesMatchOneGpu) {
    REQUIRE_GPU();
    const std::vector<std::string> model = {"num_layers=4", "moe_layer_freq=[0,1,1,1]",
                                            "dsa_indexer_topk_freq=1"};
    const std::vector<std::string> vpp = {"pipeline_model_parallel_size=2",
                                          "num_virtual_stages_per_pipeline_rank=2"};
    struct Case {
        std::string tag;
        int world;
        std::vector<std::string> sets;
        bool loads_equal;
        double grad_norm_tol = 0, step1_tol = 1e-5;
    };
    const std::vector<Case> cases = {
        {"pp2v2", 2, {}, true},
        {"pp2v2-stash", 2, {"moe_paged_stash=true"}, true},
        {"pp2v2xdcp2",
         4,
         {"dsa_indexer_use_sparse_loss=false", "calculate_per_token_loss=true", "eval_interval=0",
          "context_parallel_size=2", "dynamic_context_parallel=true",
          "sequence_packing_scheduler=default_dynamic_cp", "max_seqlen_per_dp_cp_rank=160"},
         false,
         1e-3,
         3e-5},
    };
    for (const Case& c : cases) {
        std::vector<std::string> one_sets = model;
        for (const std::string& s : c.sets)
            if (s.rfind("context_parallel", 0) != 0 && s.rfind("dynamic_context", 0) != 0 &&
                s.rfind("sequence_packing", 0) != 0 && s.rfind("max_seqlen", 0) != 0)
                one_sets.push_back(s);
        const auto one = train(trainer_recipe(1, one_sets),
                               {temp_dir(c.tag + "-one"), "", Device::CUDA, false, nullptr});
        ASSERT_EQ(one.size(), 4u) << c.tag;
        std::vector<std::string> sets = model;
        sets.insert(sets.end(), vpp.begin(), vpp.end());
        sets.insert(sets.end(), c.sets.begin(), c.sets.end());
        const auto ranks = train_threads(c.world, trainer_recipe(c.world, sets), c.tag);
        expect_metrics_match(c.tag, one, ranks, c.step1_tol, c.loads_equal, c.grad_norm_tol);
        for (size_t r = 0; r < ranks.size(); ++r)
            for (const StepMetrics& m : ranks[r]) EXPECT_FALSE(m.skipped) << c.tag;
    }
}

#endif
