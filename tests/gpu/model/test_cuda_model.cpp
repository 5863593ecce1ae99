// The whole CUDA model against the CPU model (label gpu): the same weights (rounded to bf16 so
// both backends read identical values) and the same packed micro-batch; losses and every
// parameter's gradient are compared. The CUDA model keeps activations in bf16 through two layers,
// the MTP depths and the losses, so the tolerance is a few bf16 roundings deep: 3e-2 normalized
// error per gradient tensor, 1e-2 relative on the losses.
//
// Two discrete decisions would otherwise dominate the comparison: the router's expert choice and
// the indexer's top-k flip for a few rows when bf16 moves a score across a near-tie, and each flip
// changes an expert's gradient by several percent. The gradient tests therefore route with forced
// balance (the router's selection rule is checked exactly in the op harness) and scale the indexer
// weights up so its distribution is far from the attention's: at init the two are nearly equal and
// the KL gradient (q - p) is a difference of near-equal numbers. Even so the indexer weights'
// gradients sit at a few percent (up to ~11% for the MTP layer's, whose inputs carry the whole
// backbone's bf16 rounding), so they get kIndexerTol here; the indexer loss kernels themselves are
// checked against fp64 references at 1e-5..1e-4 in ops/test_indexer_cuda.cpp
// (IndexerKlLossAndScores- Backward). The e2e_tv case: the TV gradient has the indicator 1[q > p],
// which flips wherever the main and draft distributions nearly agree (everywhere at init), so the
// MTP layer's gradients get a 1e-1 bound; the TV kernels are checked exactly in
// MtpTvSoftmaxOverlapChainAndGradient.
constexpr double kIndexerTol = 0.15;
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>

#include "gpu/harness.h"
#include "sparsetron/config/recipe.h"
#include "sparsetron/model/glm5_model.h"

#if SPARSETRON_WITH_CUDA
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/model/cuda/glm5_model.h"
#include "sparsetron/ops/copy/copy.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaModel, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA model test runs on the GPU machine";
}
#else

namespace {

MicroBatch make_batch(int64_t T, int64_t max_docs, int64_t vocab, uint64_t seed,
                      const std::vector<int64_t>& docs) {
    MicroBatch mb(T, max_docs);
    CounterRng rng(seed, 3);
    uint64_t draw = 0;
    for (int64_t len : docs) {
        std::vector<int32_t> doc(len);
        for (auto& t : doc) t = int32_t(rng.bits(draw++) % uint64_t(vocab));
        EXPECT_TRUE(mb.add_document(doc));
    }
    return mb;
}

struct Compared {
    double worst = 0;
    std::string worst_name;
};

// A CPU model with bf16-exact weights (norm weights near 1, a non-zero router bias and the
// indexer's weights scaled up make the comparisons non-trivial), planned for T rows.
struct CpuModel {
    MemoryPlan plan;
    std::unique_ptr<Glm5Model<float>> model;
};
std::unique_ptr<CpuModel> make_cpu_model(const ModelConfig& cfg, int64_t T, int64_t max_docs,
                                         int64_t chunk) {
    const float indexer_scale = 8.f;
    auto m = std::make_unique<CpuModel>();
    m->model = std::make_unique<Glm5Model<float>>(cfg, m->plan, T, max_docs, chunk);
    m->plan.allocate(Device::CPU);
    Glm5Model<float>& cpu = *m->model;
    cpu.bind();
    cpu.params().initialize(m->plan, 1234, 0.02, cfg.num_layers);
    const auto& params = cpu.params().params();
    for (size_t i = 0; i < params.size(); ++i) {
        float* w = cpu.param(int64_t(i));
        const int64_t n = params[i].numel();
        CounterRng rng(77, i);
        for (int64_t j = 0; j < n; ++j) {
            if (params[i].init == InitRule::Ones) w[j] += float(0.2 * (rng.uniform(j) - 0.5));
            if (!params[i].trainable) w[j] = float(0.05 * (rng.uniform(j) - 0.5));
            if (params[i].name.find(".indexer.") != std::string::npos &&
                params[i].init == InitRule::Normal)
                w[j] *= indexer_scale;
            w[j] = bf16_to_float(float_to_bf16(w[j]));
        }
    }
    return m;
}

LossScales parity_scales(const ModelConfig& cfg, const MicroBatch& mb) {
    LossScales sc;
    sc.backward = true;
    sc.lm = 1.0 / double(mb.num_targets());
    const int64_t D = cfg.mtp_num_layers;
    const bool tv = cfg.mtp_loss_type == "e2e_tv";
    for (int64_t k = 0; k < (tv ? 1 : D); ++k) sc.mtp.push_back(0.1 / 100.0);
    sc.indexer = 1.0;
    sc.aux = 1.0;
    return sc;
}

// The CUDA model of `cfg` with the CPU model's weights, one forward+backward of `mb`: its loss
// sums and every parameter's gradient (empty for parameters without one).
struct CudaResult {
    LossSums sums;
    std::vector<std::vector<float>> grads;
};
// `runs` > 1: that many forward+backward passes of `mb` on the same model, the last one's.
CudaResult run_gpu(const ModelConfig& cfg, Glm5Model<float>& cpu, int64_t T, int64_t max_docs,
                   int64_t chunk, const MicroBatch& mb, const LossScales& sc,
                   bool fp8_blockwise = false, int runs = 1) {
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    MemoryPlan dplan;
    cuda::CudaGlm5Model gm(cfg, cpu.params(), dplan, T, max_docs, chunk, 0, fp8_blockwise);
    dplan.allocate(Device::CUDA);
    gm.bind(ctx);
    const auto& params = cpu.params().params();
    for (size_t i = 0; i < params.size(); ++i)
        copy_to_device(gm.cuda_params()[int64_t(i)].master, cpu.param(int64_t(i)),
                       params[i].numel() * sizeof(float));
    gm.refresh_bf16(ctx);
    gm.load_inputs(ctx, mb, sc);
    CudaResult out;
    for (int i = 0; i < runs; ++i) {
        cuda::zero(ctx, dplan.class_base(MemClass::Gradients),
                   dplan.class_bytes(MemClass::Gradients));
        out.sums = gm.forward_backward(ctx, sc);
    }
    session.synchronize();
    for (size_t i = 0; i < params.size(); ++i) {
        out.grads.emplace_back();
        if (!params[i].trainable) continue;
        out.grads.back().resize(size_t(params[i].numel()));
        copy_to_host(out.grads.back().data(), gm.cuda_params()[int64_t(i)].grad,
                     out.grads.back().size() * sizeof(float));
    }
    return out;
}

// `aux_only`: the MoE sequence aux loss is the step's only objective (every other scale 0), so
// every gradient compared is the aux loss's. `docs`: the packed documents' lengths.
void run_parity(ModelConfig cfg, const std::string& tag, double mtp_tol = 3e-2,
                bool aux_only = false, const std::vector<int64_t>& docs = {50, 70}) {
    const int64_t T = 128, max_docs = 4, chunk = 48;
    auto cm = make_cpu_model(cfg, T, max_docs, chunk);
    Glm5Model<float>& cpu = *cm->model;
    const auto& params = cpu.params().params();
    MicroBatch mb = make_batch(T, max_docs, cfg.vocab_size, 9, docs);
    LossScales sc = parity_scales(cfg, mb);
    if (aux_only) {
        sc.lm = sc.indexer = 0;
        for (double& m : sc.mtp) m = 0;
    }
    const bool tv = cfg.mtp_loss_type == "e2e_tv";
    cpu.load_inputs(mb);
    LossSums ref = cpu.forward_backward(sc);
    const CudaResult gr = run_gpu(cfg, cpu, T, max_docs, chunk, mb, sc);
    const LossSums& got = gr.sums;

    std::cout << "[model " << tag << "] lm " << got.lm_loss_sum << " vs " << ref.lm_loss_sum
              << ", indexer " << got.indexer_loss << " vs " << ref.indexer_loss << "\n";
    EXPECT_EQ(got.lm_targets, ref.lm_targets);
    EXPECT_NEAR(got.lm_loss_sum, ref.lm_loss_sum, 1e-2 * std::fabs(ref.lm_loss_sum));
    ASSERT_EQ(got.mtp_sum.size(), ref.mtp_sum.size());
    for (size_t k = 0; k < ref.mtp_sum.size(); ++k) {
        std::cout << "[model " << tag << "] mtp[" << k << "] " << got.mtp_sum[k] << " vs "
                  << ref.mtp_sum[k] << "\n";
        EXPECT_NEAR(got.mtp_sum[k], ref.mtp_sum[k], 1e-2 * std::fabs(ref.mtp_sum[k]) + 1e-6);
        EXPECT_EQ(got.mtp_count[k], ref.mtp_count[k]);
    }
    if (tv) {
        EXPECT_NEAR(got.mtp_acceptance_sum, ref.mtp_acceptance_sum, 1e-2 * ref.mtp_acceptance_sum);
    }
    if (cfg.dsa_indexer_loss_coeff > 0 && !aux_only) {
        EXPECT_GT(ref.indexer_loss, 0);
        EXPECT_NEAR(got.indexer_loss, ref.indexer_loss, 3e-2 * ref.indexer_loss);
    }
    if (cfg.moe_aux_loss_coeff > 0) {
        std::cout << "[model " << tag << "] aux " << got.aux_loss << " vs " << ref.aux_loss
                  << " (MTP layer's " << got.mtp_aux_loss << " vs " << ref.mtp_aux_loss << ")\n";
        EXPECT_GT(ref.aux_loss, ref.mtp_aux_loss);
        EXPECT_GT(ref.mtp_aux_loss, 0);
        EXPECT_NEAR(got.aux_loss, ref.aux_loss, 1e-3 * ref.aux_loss);
        EXPECT_NEAR(got.mtp_aux_loss, ref.mtp_aux_loss, 1e-3 * ref.mtp_aux_loss);
    } else {
        EXPECT_EQ(got.aux_loss, 0.0);
    }
    // Every trainable parameter's gradient.
    Compared c;
    int64_t checked = 0, routers = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        if (!params[i].trainable) continue;
        const int64_t n = params[i].numel();
        const std::vector<float>& g = gr.grads[i];
        const float* r = cpu.grad(int64_t(i));
        double num = 0, den = 0;
        for (int64_t j = 0; j < n; ++j) {
            ASSERT_TRUE(std::isfinite(g[j])) << params[i].name;
            num += (double(g[j]) - r[j]) * (double(g[j]) - r[j]);
            den += double(r[j]) * r[j];
        }
        if (den == 0) {
            EXPECT_EQ(num, 0) << params[i].name << ": the CPU gradient is zero, the GPU's is not";
            continue;
        }
        const double err = std::sqrt(num / den);
        ++checked;
        if (params[i].name.find(".mlp.gate.weight") != std::string::npos) ++routers;
        if (err > c.worst) c.worst = err, c.worst_name = params[i].name;
        const bool indexer = params[i].name.find(".indexer.") != std::string::npos;
        EXPECT_LE(err, indexer ? kIndexerTol : params[i].mtp ? mtp_tol : 3e-2) << params[i].name;
    }
    std::cout << "[model " << tag << "] " << checked << " gradients compared, worst normalized "
              << "error " << c.worst << " (" << c.worst_name << ")\n";
    // Alone, the aux loss reaches what lies below each router (not the heads or later layers).
    EXPECT_GT(checked, aux_only ? 10 : 30);
    if (cfg.moe_aux_loss_coeff > 0) {
        EXPECT_GT(routers, 0) << "no router weight had a gradient";
    }
}

}  // namespace

// An idle rank's micro-batch (dynamic CP with expert parallelism runs one so that it joins its
// peers' exchanges): no document, every row padding. Every op of the step runs on it (the MoE
// routes nothing, the losses count nothing) and it must leave no loss and no gradient: all
// finite and zero, eagerly, with the sparse and the dense indexer loss and e2e TV.
TEST(CudaModel, AnEmptyMicroBatchRunsEveryOpAndLeavesNothing) {
    REQUIRE_GPU();
    for (const bool tv : {false, true}) {
        ModelConfig cfg = builtin_tiny_recipe().model;
        cfg.dsa_indexer_loss_coeff = 0.1;
        if (tv) {
            cfg.mtp_loss_type = "e2e_tv";
            cfg.mtp_detach_heads = true;
            cfg.dsa_indexer_use_sparse_loss = false;
        }
        const int64_t T = 128, max_docs = 4, chunk = 48;
        auto cm = make_cpu_model(cfg, T, max_docs, chunk);
        MicroBatch empty(T, max_docs);
        ASSERT_EQ(empty.num_documents, 0);
        LossScales sc;
        sc.backward = true;
        sc.lm = 1.0, sc.indexer = 1.0, sc.aux = 1.0;
        sc.mtp.assign(tv ? 1 : size_t(cfg.mtp_num_layers), 0.01);
        const CudaResult gr = run_gpu(cfg, *cm->model, T, max_docs, chunk, empty, sc);
        EXPECT_EQ(gr.sums.lm_targets, 0);
        EXPECT_EQ(gr.sums.lm_loss_sum, 0.0);
        EXPECT_EQ(gr.sums.indexer_loss, 0.0);
        for (double v : gr.sums.mtp_sum) EXPECT_EQ(v, 0.0);
        for (int64_t n : gr.sums.mtp_count) EXPECT_EQ(n, 0);
        const auto& params = cm->model->params().params();
        int64_t checked = 0;
        for (size_t i = 0; i < params.size(); ++i)
            for (float g : gr.grads[i]) {
                ASSERT_TRUE(std::isfinite(g)) << params[i].name << (tv ? " (e2e TV)" : "");
                ASSERT_EQ(g, 0.f) << params[i].name << (tv ? " (e2e TV)" : "");
                ++checked;
            }
        EXPECT_GT(checked, 1000);
        std::cout << "[empty micro-batch" << (tv ? ", e2e TV" : "") << "] " << checked
                  << " gradient values, all zero\n";
    }
}

TEST(CudaModel, TinyRecipeMatchesCpu) {
    REQUIRE_GPU();
    // The tiny recipe: dense + MoE layer, DSA with IndexShare and the sparse indexer loss,
    // repeated MTP x2 with cross-entropy and latent-KV sharing.
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.moe_router_force_load_balancing = true;
    // The masked attention's backward from the forward's kept probabilities (the test below
    // recomputes them, the default).
    cfg.dsa_saved_probs_max_mib = 2048;
    run_parity(cfg, "tiny");
}

// The MoE sequence aux loss (DeepSeek-V3's, per packed document) on every MoE application (the
// backbone's MoE layer and the MTP layer's two depths): with the other losses, and alone.
TEST(CudaModel, SequenceAuxLossMatchesCpu) {
    REQUIRE_GPU();
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.moe_aux_loss_coeff = 0.3;
    // Forced routes are the same on both (no near-tie flips). They give token t experts 2t and
    // 2t + 1 (mod 4): a document of an even length then uses every expert equally and the aux
    // loss has no gradient, so the first document here is 51 tokens long.
    cfg.moe_router_force_load_balancing = true;
    run_parity(cfg, "aux loss", 3e-2, false, {51, 70});
    run_parity(cfg, "aux loss alone", 3e-2, /*aux_only=*/true, {51, 70});
}

TEST(CudaModel, TinyRecipeTopkCoveringAllKeysMatchesCpu) {
    REQUIRE_GPU();
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.moe_router_force_load_balancing = true;
    cfg.dsa_indexer_topk = 128;  // no selection: no top-k flips
    run_parity(cfg, "tiny, top-k of all");
}

TEST(CudaModel, E2eTvDetachedDenseIndexerLossMatchesCpu) {
    REQUIRE_GPU();
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.mtp_loss_type = "e2e_tv";
    cfg.mtp_detach_heads = true;
    cfg.mtp_num_layers = 3;
    cfg.dsa_indexer_use_sparse_loss = false;
    cfg.dsa_mtp_index_kv_share = false;
    cfg.moe_router_force_load_balancing = true;
    cfg.dsa_saved_probs_max_mib = 2048;
    // One block of target rows per chunk of 48 rows, shared by the depths (the form without CP;
    // CP's block per depth runs in the multi-GPU CP tests).
    run_parity(cfg, "e2e_tv", 1e-1);
}

TEST(CudaModel, KvSharingAtOffsetTwoMatchesCpu) {
    REQUIRE_GPU();
    // Offset 2: both backbone layers full, and the MTP layer, numbered 1 inside its block, with
    // its own indexer; depth 1 computes the latent K' and top-k that depths 2 and 3 reuse.
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.dsa_indexer_skip_topk_offset = 2;
    cfg.mtp_num_layers = 3;
    cfg.dsa_mtp_index_kv_share = true;
    ASSERT_TRUE(dsa_layer_is_full(cfg, cfg.num_layers));
    cfg.moe_router_force_load_balancing = true;
    cfg.dsa_saved_probs_max_mib = 2048;
    run_parity(cfg, "kv sharing at offset 2");
}

TEST(CudaModel, DistinctMtpLayersMatchCpu) {
    REQUIRE_GPU();
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.mtp_num_layers = 3;
    cfg.mtp_use_repeated_layer = false;  // a layer per depth: model.layers.{L, L+1, L+2}
    cfg.dsa_mtp_index_kv_share = false;
    cfg.moe_router_force_load_balancing = true;
    cfg.dsa_saved_probs_max_mib = 2048;
    run_parity(cfg, "distinct MTP layers");
}

// The forms the memory-saving modes are checked on, each run on one configuration:
// the masked expanded attention with the absorbed, kv-sharing MTP layer (the base recipe), the
// gathered absorbed form everywhere (top-k 16 of 128 keys), dense attention without DSA, and FP8
// blockwise linears. `deterministic`: two runs are meant to agree bit for bit (no backward
// accumulates with atomics; the gathered sparse attention and the dense attention do).
struct SameStepCase {
    const char* tag;
    ModelConfig cfg;
    bool fp8, deterministic;
};
std::vector<SameStepCase> same_step_cases(const ModelConfig& base) {
    std::vector<SameStepCase> cases = {{"masked + absorbed MTP", base, false, true},
                                       {"gathered absorbed", base, false, false},
                                       {"dense attention", base, false, false},
                                       {"fp8 blockwise", base, true, true}};
    cases[1].cfg.dsa_indexer_topk = 16;
    cases[2].cfg.experimental_attention_variant = "none";
    cases[2].cfg.dsa_indexer_loss_coeff = 0;
    for (SameStepCase& k : cases) k.cfg.moe_router_force_load_balancing = true;
    return cases;
}

// `r` against `a`, with `a2` a second run of `a`'s. Where two runs of a form meant to be
// deterministic agree bit for bit, `r` must equal `a` bit for bit (the strict check of recompute
// and offload); where they do not, within twice their spread plus 1e-6 globally, 1e-5 per tensor.
// The forms with atomics can land run to run further apart than one pair of runs shows, identical
// configurations included (docs/perf/log/2026-12-03-long-context.md), and their CPU parity holds
// to 1e-2 per tensor: for them the losses within 1e-6, all gradients together (their global norm
// of differences) within twice the spread plus 5e-3, each tensor within twice its spread plus
// 1e-2. A wrong buffer (an O(1) change of some gradient) still fails.
void expect_same_step(const std::string& tag, const std::vector<ParamInfo>& params,
                      const SameStepCase& k, const CudaResult& a, const CudaResult& a2,
                      const CudaResult& r) {
    // The worst per-tensor relative difference to `a` (and its tensor), and the global one.
    auto spread = [&](const CudaResult& x, std::string* worst, double* global) {
        double w = 0, all_num = 0, all_den = 0;
        for (size_t i = 0; i < params.size(); ++i) {
            double num = 0, den = 0;
            for (size_t j = 0; j < x.grads[i].size(); ++j) {
                const double d = double(x.grads[i][j]) - a.grads[i][j];
                num += d * d;
                den += double(a.grads[i][j]) * a.grads[i][j];
            }
            all_num += num, all_den += den;
            const double e = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
            if (e > w) w = e, *worst = params[i].name;
        }
        *global = all_den > 0 ? std::sqrt(all_num / all_den) : std::sqrt(all_num);
        return w;
    };
    std::string w1, w2;
    double noise_all = 0, diff_all = 0;
    const double noise = spread(a2, &w1, &noise_all), diff = spread(r, &w2, &diff_all);
    std::cout << "[" << tag << "] lm " << r.sums.lm_loss_sum << " vs " << a.sums.lm_loss_sum
              << ", run-to-run " << noise << " (all " << noise_all << "), difference " << diff
              << " (all " << diff_all << "; worst " << w2 << ")\n";
    EXPECT_GT(a.sums.lm_loss_sum, 0);
    if (k.deterministic && noise == 0 && a2.sums.lm_loss_sum == a.sums.lm_loss_sum) {
        EXPECT_EQ(r.sums.lm_loss_sum, a.sums.lm_loss_sum) << tag;
        EXPECT_EQ(r.sums.mtp_sum, a.sums.mtp_sum) << tag;
        EXPECT_EQ(r.sums.indexer_loss, a.sums.indexer_loss) << tag;
        EXPECT_EQ(diff, 0) << tag << ": " << w2;
    } else {
        EXPECT_NEAR(r.sums.lm_loss_sum, a.sums.lm_loss_sum, 1e-6 * a.sums.lm_loss_sum) << tag;
        EXPECT_LE(diff_all, 2 * noise_all + (k.deterministic ? 1e-6 : 5e-3)) << tag;
        EXPECT_LE(diff, 2 * noise + (k.deterministic ? 1e-5 : 1e-2)) << tag << ": " << w2;
    }
}

// Selective recompute (core_attn, mla_up_proj, layernorm, moe_act, mlp, shared_experts) reruns the
// forward's kernels on the same inputs before the backward: the same losses and gradients as
// keeping the outputs (same_step_cases' forms on the tiny recipe: a dense layer, MoE layers with a
// shared expert).
TEST(CudaModel, SelectiveRecomputeGivesTheSameLossesAndGradients) {
    REQUIRE_GPU();
    for (const SameStepCase& k : same_step_cases(builtin_tiny_recipe().model)) {
        const int64_t T = 128, max_docs = 4, chunk = 48;
        auto cm = make_cpu_model(k.cfg, T, max_docs, chunk);
        const auto& params = cm->model->params().params();
        const MicroBatch mb = make_batch(T, max_docs, k.cfg.vocab_size, 9, {50, 70});
        const LossScales sc = parity_scales(k.cfg, mb);
        ModelConfig rc = k.cfg;
        rc.recompute_granularity = "selective";
        rc.recompute_modules = recompute_module_names();
        const CudaResult a = run_gpu(k.cfg, *cm->model, T, max_docs, chunk, mb, sc, k.fp8);
        const CudaResult a2 = run_gpu(k.cfg, *cm->model, T, max_docs, chunk, mb, sc, k.fp8);
        const CudaResult r = run_gpu(rc, *cm->model, T, max_docs, chunk, mb, sc, k.fp8);
        expect_same_step("recompute " + std::string(k.tag), params, k, a, a2, r);
    }
}

// recompute_block_rows: the recomputed absorbed attention (over the gathered kernels), the dense
// MLP and the shared expert run their forward and backward a block of rows at a time (48, 48 and
// 32 of 128 rows), each attention block adding its keys' gradient to the others': the same losses
// and gradients as one block, within the gathered form's run-to-run spread (its key gradients
// add with atomics). With the indexer loss its full DSA layers keep one block (their teacher
// reads the whole Q'); without it every layer takes blocks.
TEST(CudaModel, RecomputeBlocksGiveTheSameLossesAndGradients) {
    REQUIRE_GPU();
    const SameStepCase gathered = same_step_cases(builtin_tiny_recipe().model)[1];
    for (const bool indexer_loss : {true, false}) {
        SameStepCase k = gathered;
        if (!indexer_loss) k.cfg.dsa_indexer_loss_coeff = 0;
        k.cfg.recompute_granularity = "selective";
        k.cfg.recompute_modules = recompute_module_names();
        const int64_t T = 128, max_docs = 4, chunk = 48;
        auto cm = make_cpu_model(k.cfg, T, max_docs, chunk);
        const auto& params = cm->model->params().params();
        const MicroBatch mb = make_batch(T, max_docs, k.cfg.vocab_size, 9, {50, 70});
        const LossScales sc = parity_scales(k.cfg, mb);
        ModelConfig bc = k.cfg;
        bc.recompute_block_rows = 48;
        {
            // The blocks are planned: one block's rows in the query-block buffers.
            MemoryPlan plan;
            cuda::CudaGlm5Model gm(bc, cm->model->params(), plan, T, max_docs, chunk);
            bool q_block = false, mlp_block = false;
            for (const PlanEntry& e : plan.entries()) {
                if (e.name == "attn.query_block.q_absorbed") q_block = e.shape[0] == 48;
                if (e.name == "mlp.recomputed.act") mlp_block = e.shape[0] == 48;
            }
            EXPECT_TRUE(q_block && mlp_block) << plan.format(40);
        }
        const CudaResult a = run_gpu(k.cfg, *cm->model, T, max_docs, chunk, mb, sc);
        const CudaResult a2 = run_gpu(k.cfg, *cm->model, T, max_docs, chunk, mb, sc);
        const CudaResult b = run_gpu(bc, *cm->model, T, max_docs, chunk, mb, sc);
        expect_same_step(indexer_loss ? "blocks, indexer loss" : "blocks, no indexer loss", params,
                         k, a, a2, b);
    }
}

// Activation offload moves the named modules' saved activations of every layer application but
// the last two to pinned host memory and back (model/cuda/activation_offload.h): the backward reads
// the same bytes, so the same losses and gradients as keeping them (bit for bit where the step is
// deterministic). Four layers and three MTP depths: seven applications sharing two device
// regions, five of them offloaded, run twice on the same model (the second run starts from the
// regions the first left). Forms as for recompute, plus offload beside recompute of the other
// modules.
TEST(CudaModel, ActivationOffloadGivesTheSameLossesAndGradients) {
    REQUIRE_GPU();
    Recipe r = builtin_tiny_recipe();
    r.model.num_layers = 4;
    r.model.moe_layer_freq = "[0,1,1,1]";
    r.model.mtp_num_layers = 3;
    r.model.dsa_saved_probs_max_mib = 2048;  // the masked form's probabilities offloaded too
    r.validate();
    std::vector<SameStepCase> cases = same_step_cases(r.model);
    cases.push_back({"beside recompute", cases[0].cfg, false, true});
    for (SameStepCase& k : cases) {
        const int64_t T = 128, max_docs = 4, chunk = 48;
        auto cm = make_cpu_model(k.cfg, T, max_docs, chunk);
        const auto& params = cm->model->params().params();
        const MicroBatch mb = make_batch(T, max_docs, k.cfg.vocab_size, 9, {50, 70});
        const LossScales sc = parity_scales(k.cfg, mb);
        ModelConfig oc = k.cfg;
        oc.fine_grained_activation_offloading = true;
        oc.offload_modules = {"attn_norm", "mlp_norm",   "qkv_linear", "core_attn",
                              "attn_proj", "expert_fc1", "moe_act",    "fused_group_mlp"};
        if (std::string(k.tag) == "beside recompute") {
            k.cfg.recompute_granularity = oc.recompute_granularity = "selective";
            k.cfg.recompute_modules =
                oc.recompute_modules = {"core_attn", "layernorm", "mlp", "shared_experts"};
            oc.offload_modules = {"qkv_linear", "expert_fc1", "moe_act"};
        }
        const CudaResult a = run_gpu(k.cfg, *cm->model, T, max_docs, chunk, mb, sc, k.fp8);
        const CudaResult a2 = run_gpu(k.cfg, *cm->model, T, max_docs, chunk, mb, sc, k.fp8);
        const CudaResult o = run_gpu(oc, *cm->model, T, max_docs, chunk, mb, sc, k.fp8, 2);
        expect_same_step("offload " + std::string(k.tag), params, k, a, a2, o);
    }
}

TEST(CudaModel, ExpandedAttentionWithoutDsaMatchesCpu) {
    REQUIRE_GPU();
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.experimental_attention_variant = "none";
    cfg.dsa_indexer_loss_coeff = 0;
    cfg.moe_router_force_load_balancing = true;
    run_parity(cfg, "dense attention");
}

// THD packing at length: a 32K-token document (512x the top-k of 64), a 17-token one and a
// 3000-token one in one micro-batch of the tiny recipe (IndexShare layers, two MTP depths sharing
// depth 1's latent keys, the sparse indexer loss), CUDA against the CPU reference: the losses of
// every part agree (the top-k flips bf16 causes at near-ties move them little; the gradients are
// compared at short lengths above); the CPU reference's isolation of packed documents is checked
// in Model.PackedDocumentsDoNotSeeEachOther.
TEST(CudaModel, VeryUnequalPackedDocumentsAtLengthMatchCpu) {
    REQUIRE_GPU();
    const int64_t T = 35840, max_docs = 4, chunk = 512;
    ModelConfig cfg = builtin_tiny_recipe().model;
    cfg.moe_router_force_load_balancing = true;
    auto cm = make_cpu_model(cfg, T, max_docs, chunk);
    Glm5Model<float>& cpu = *cm->model;
    const MicroBatch mb = make_batch(T, max_docs, cfg.vocab_size, 5, {32768, 17, 3000});
    const LossScales sc = parity_scales(cfg, mb);
    const CudaResult gr = run_gpu(cfg, cpu, T, max_docs, chunk, mb, sc);
    cpu.load_inputs(mb);
    const LossSums ref = cpu.forward_backward(sc);
    std::cout << "[model 32K+17+3000] lm " << gr.sums.lm_loss_sum << " vs " << ref.lm_loss_sum
              << ", indexer " << gr.sums.indexer_loss << " vs " << ref.indexer_loss << "\n";
    EXPECT_EQ(gr.sums.lm_targets, ref.lm_targets);
    EXPECT_EQ(ref.lm_targets, 32767 + 16 + 2999);
    EXPECT_NEAR(gr.sums.lm_loss_sum, ref.lm_loss_sum, 2e-3 * ref.lm_loss_sum);
    ASSERT_EQ(gr.sums.mtp_sum.size(), ref.mtp_sum.size());
    for (size_t k = 0; k < ref.mtp_sum.size(); ++k) {
        EXPECT_EQ(gr.sums.mtp_count[k], ref.mtp_count[k]);
        EXPECT_NEAR(gr.sums.mtp_sum[k], ref.mtp_sum[k], 2e-3 * ref.mtp_sum[k]) << k;
    }
    EXPECT_GT(ref.indexer_loss, 0);
    EXPECT_NEAR(gr.sums.indexer_loss, ref.indexer_loss, 5e-2 * ref.indexer_loss);
    for (size_t i = 0; i < gr.grads.size(); ++i)
        for (float g : gr.grads[i]) ASSERT_TRUE(std::isfinite(g)) << cpu.params().params()[i].name;
}

// A micro-batch longer than the indexer's query block: the indexer scores and selects per block of
// query rows against the keys before the block's end, and with its loss scores each block again
// after the attention for the block's KL and gradient (the form that keeps its buffers linear in
// the length). Blocks of 1024 rows (five at 4608 tokens) against one block of every row, with the
// loss off and on: the same losses and gradients (the blocks select what the whole does, so the
// model's own gradients match; the indexer's own add each block's key gradients in turn). One
// document of 4400 tokens (~70x the top-k of 64) and two short ones; the head's dlogits go in
// groups of one 48-row chunk here. Against the CPU model only the losses are compared: at this
// length bf16 moves many scores across near-ties of the top-k.
TEST(CudaModel, LongDocumentIndexerInQueryBlocksMatchesTheWholeForm) {
    REQUIRE_GPU();
    const int64_t T = 4608, max_docs = 4, chunk = 48;
    for (const bool loss : {false, true}) {
        SCOPED_TRACE(loss ? "indexer loss" : "no indexer loss");
        ModelConfig cfg = builtin_tiny_recipe().model;
        cfg.moe_router_force_load_balancing = true;
        if (!loss) cfg.dsa_indexer_loss_coeff = 0;
        ASSERT_EQ(cfg.dsa_indexer_loss_coeff != 0, loss);
        auto cm = make_cpu_model(cfg, T, max_docs, chunk);
        Glm5Model<float>& cpu = *cm->model;
        MicroBatch mb = make_batch(T, max_docs, cfg.vocab_size, 9, {4400, 17, 150});
        const LossScales sc = parity_scales(cfg, mb);
        ModelConfig blocks_cfg = cfg, whole_cfg = cfg;
        blocks_cfg.dsa_indexer_query_block = 1024;
        whole_cfg.dsa_indexer_query_block = T;
        const CudaResult blocks = run_gpu(blocks_cfg, cpu, T, max_docs, chunk, mb, sc);
        const CudaResult whole = run_gpu(whole_cfg, cpu, T, max_docs, chunk, mb, sc);
        cpu.load_inputs(mb);
        const LossSums ref = cpu.forward_backward(sc);
        std::cout << "[model long document" << (loss ? ", indexer loss" : "") << "] lm blocks "
                  << blocks.sums.lm_loss_sum << ", whole " << whole.sums.lm_loss_sum << ", cpu "
                  << ref.lm_loss_sum << "; indexer blocks " << blocks.sums.indexer_loss
                  << ", whole " << whole.sums.indexer_loss << ", cpu " << ref.indexer_loss << "\n";
        EXPECT_NEAR(blocks.sums.lm_loss_sum, whole.sums.lm_loss_sum,
                    1e-6 * std::fabs(whole.sums.lm_loss_sum));
        EXPECT_NEAR(blocks.sums.lm_loss_sum, ref.lm_loss_sum, 1e-3 * std::fabs(ref.lm_loss_sum));
        ASSERT_EQ(blocks.sums.mtp_sum.size(), ref.mtp_sum.size());
        for (size_t k = 0; k < ref.mtp_sum.size(); ++k) {
            EXPECT_NEAR(blocks.sums.mtp_sum[k], whole.sums.mtp_sum[k],
                        1e-6 * std::fabs(whole.sums.mtp_sum[k]));
            EXPECT_NEAR(blocks.sums.mtp_sum[k], ref.mtp_sum[k], 1e-3 * std::fabs(ref.mtp_sum[k]));
        }
        if (loss) {
            EXPECT_GT(whole.sums.indexer_loss, 0);
            EXPECT_NEAR(blocks.sums.indexer_loss, whole.sums.indexer_loss,
                        1e-5 * whole.sums.indexer_loss);
            EXPECT_NEAR(blocks.sums.indexer_loss, ref.indexer_loss, 5e-2 * ref.indexer_loss);
        }
        const auto& params = cpu.params().params();
        int64_t checked = 0, indexer = 0;
        double worst = 0, worst_indexer = 0;
        for (size_t i = 0; i < params.size(); ++i) {
            if (!params[i].trainable) continue;
            const double err = max_rel_error(blocks.grads[i], whole.grads[i]);
            if (params[i].name.find(".indexer.") != std::string::npos) {
                if (!loss) continue;
                // The key gradients of the blocks add in another order (fp32 GEMMs), and the
                // recomputed block scores may differ from the whole's in the last bits.
                EXPECT_LE(err, 1e-3) << params[i].name;
                worst_indexer = std::max(worst_indexer, err);
                ++indexer;
                continue;
            }
            worst = std::max(worst, err);
            // The attention's gathered backward adds key gradients with fp32 atomics.
            EXPECT_LE(err, 1e-4) << params[i].name;
            ++checked;
        }
        std::cout << "[model long document] " << checked << " gradients, blocks vs whole: worst "
                  << worst << "; " << indexer << " indexer gradients: worst " << worst_indexer
                  << "\n";
        EXPECT_GT(checked, 30);
        if (loss) {
            EXPECT_GT(indexer, 5);
        }
    }
}

#endif  // SPARSETRON_WITH_CUDA
