// The full architecture (DSA with IndexShare, MoE with a shared expert and aux loss, repeated MTP
// with both losses): every trainable parameter's gradient against fp64 finite differences of the
// objective that parameter is trained by (SPEC §3.1: the indexer only by its KL loss; §5: detached
// MTP heads send nothing into the backbone; teachers and TV targets carry no gradient).
#include <gtest/gtest.h>

#include <cmath>

#include "sparsetron/model/glm5_model.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

ModelConfig full_config(const std::string& mtp_loss, bool detach, bool sparse_loss) {
    ModelConfig m;
    m.num_layers = 2;
    m.hidden_size = 8;
    m.num_attention_heads = 2;
    m.q_lora_rank = 6;
    m.kv_lora_rank = 4;
    m.qk_head_dim = 4;
    m.qk_pos_emb_head_dim = 2;
    m.v_head_dim = 3;
    m.ffn_hidden_size = 10;
    m.vocab_size = 11;
    m.rotary_base = 50.0;
    m.moe_layer_pattern = {0, 1};
    m.num_experts = 4;
    m.moe_ffn_hidden_size = 5;
    m.moe_shared_expert_intermediate_size = 5;
    m.moe_router_topk = 2;
    m.moe_router_topk_scaling_factor = 2.5;
    m.moe_aux_loss_coeff = 0.3;
    m.experimental_attention_variant = "dsa";
    m.dsa_indexer_n_heads = 2;
    m.dsa_indexer_head_dim = 4;
    m.dsa_indexer_topk = 3;  // smaller than the documents: really sparse
    m.dsa_indexer_topk_freq = 2;
    m.dsa_indexer_skip_topk_offset = 1;  // layer 0 full, layer 1 shared, MTP layer (2) full
    m.dsa_indexer_loss_coeff = 0.7;
    m.dsa_indexer_use_sparse_loss = sparse_loss;
    m.mtp_num_layers = 2;
    m.mtp_loss_type = mtp_loss;
    m.mtp_detach_heads = detach;
    m.mtp_loss_scaling_factor = 0.5;
    return m;
}

struct Objectives {
    double backbone, mtp, indexer;
};

void check_full_model(const ModelConfig& cfg) {
    MemoryPlan plan;
    Glm5Model<double> model(cfg, plan, 16, 3, 5);
    plan.allocate(Device::CPU);
    model.bind();
    model.params().initialize(plan, 11, 0.6, cfg.num_layers);
    const auto& params = model.params().params();
    for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].shape.size() == 1 && params[i].trainable)
            for (int64_t j = 0; j < params[i].numel(); ++j)
                model.param(i)[j] =
                    1.0 + 0.1 * ((j % 5) - 2) + (params[i].init == InitRule::Zeros ? -1.0 : 0.0);
        if (!params[i].trainable)  // a non-zero expert bias
            for (int64_t j = 0; j < params[i].numel(); ++j) model.param(i)[j] = 0.05 * (j % 3);
    }
    MicroBatch mb(16, 3);
    mb.add_document({1, 5, 2, 9, 3, 7, 8});
    mb.add_document({4, 4, 7, 10, 0, 6});
    model.load_inputs(mb);

    LossScales sc;
    sc.backward = true;
    sc.lm = 0.37;
    sc.mtp =
        cfg.mtp_loss_type == "e2e_tv" ? std::vector<double>{0.8} : std::vector<double>{0.8, 0.6};
    sc.indexer = 1.0;
    sc.aux = 1.0;
    auto objectives = [&](bool backward) {
        LossScales s = sc;
        s.backward = backward;
        LossSums r = model.forward_backward(s);
        double mtp = 0;
        for (size_t k = 0; k < r.mtp_sum.size(); ++k) mtp += sc.mtp[k] * r.mtp_sum[k];
        return Objectives{sc.lm * r.lm_loss_sum + r.aux_loss - r.mtp_aux_loss, mtp + r.mtp_aux_loss,
                          r.indexer_loss};
    };
    for (size_t i = 0; i < params.size(); ++i)
        if (params[i].trainable) std::fill_n(model.grad(i), params[i].numel(), 0.0);
    Objectives base = objectives(true);
    EXPECT_GT(base.indexer, 0.0);
    EXPECT_GT(base.mtp, 0.0);
    const double eps = 1e-6;
    int checked = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        if (!params[i].trainable) continue;
        const bool indexer = params[i].name.find(".indexer.") != std::string::npos;
        const bool mtp = params[i].mtp;
        auto objective = [&](const Objectives& o) {
            if (indexer) return o.indexer;       // trained by its KL loss only
            if (mtp) return o.backbone + o.mtp;  // lm does not depend on MTP weights
            return o.backbone + (cfg.mtp_detach_heads ? 0.0 : o.mtp);
        };
        const int64_t n = params[i].numel();
        for (int64_t s = 0; s < std::min<int64_t>(5, n); ++s) {
            const int64_t j = (s * 7919 + 3) % n;
            double* w = model.param(i) + j;
            const double keep = *w;
            *w = keep + eps;
            const double up = objective(objectives(false));
            *w = keep - eps;
            const double down = objective(objectives(false));
            *w = keep;
            const double fd = (up - down) / (2 * eps), an = model.grad(i)[j];
            EXPECT_NEAR(an, fd, 2e-5 * std::max(1.0, std::fabs(fd)))
                << params[i].name << "[" << j << "]";
            ++checked;
        }
    }
    EXPECT_GT(checked, 100);
}

}  // namespace

TEST(FullModel, GradientsWithCrossEntropyMtpAndSparseIndexerLoss) {
    check_full_model(full_config("cross_entropy", false, true));
}

TEST(FullModel, GradientsWithE2eTvAndDenseIndexerLoss) {
    ModelConfig cfg = full_config("e2e_tv", true, false);
    cfg.moe_capacity_factor = 0.75;  // some rows dropped: the bound is enforced, not silent
    check_full_model(cfg);
}

TEST(FullModel, GradientsWithMtpLatentKvAndTopkSharing) {
    ModelConfig cfg = full_config("e2e_tv", true, true);
    cfg.mtp_num_layers = 3;  // depths 2 and 3 reuse depth 1's K' and top-k
    cfg.dsa_mtp_index_kv_share = true;
    check_full_model(cfg);
}

// Offset 2 makes both backbone layers full; the MTP layer, numbered 1 inside its block as
// Megatron numbers it, is full too: depth 1 runs its indexer (and its loss), depths 2 and 3 reuse
// its K' and top-k.
TEST(FullModel, GradientsWithMtpKvSharingAtOffsetTwo) {
    ModelConfig cfg = full_config("e2e_tv", true, true);
    cfg.mtp_num_layers = 3;
    cfg.dsa_mtp_index_kv_share = true;
    cfg.dsa_indexer_skip_topk_offset = 2;
    ASSERT_TRUE(dsa_layer_is_full(cfg, 1));
    ASSERT_TRUE(dsa_layer_is_full(cfg, cfg.num_layers));
    check_full_model(cfg);
}

// Depth 1 computes the same thing with or without kv sharing (its own K' and top-k); only the
// later depths, which reuse depth 1's K' and top-k, change.
TEST(FullModel, KvSharingChangesOnlyTheLaterDepths) {
    ModelConfig cfg = full_config("cross_entropy", false, false);
    auto depth_sums = [&](bool share) {
        ModelConfig c = cfg;
        c.dsa_mtp_index_kv_share = share;
        MemoryPlan plan;
        Glm5Model<double> model(c, plan, 16, 3, 5);
        plan.allocate(Device::CPU);
        model.bind();
        model.params().initialize(plan, 11, 0.6, c.num_layers);
        MicroBatch mb(16, 3);
        mb.add_document({1, 5, 2, 9, 3, 7, 8});
        mb.add_document({4, 4, 7, 10, 0, 6});
        model.load_inputs(mb);
        LossScales sc;
        sc.backward = false;
        sc.mtp = {1.0, 1.0};
        return model.forward_backward(sc).mtp_sum;
    };
    const std::vector<double> shared = depth_sums(true), own = depth_sums(false);
    ASSERT_EQ(shared.size(), 2u);
    ASSERT_EQ(own.size(), 2u);
    EXPECT_EQ(shared[0], own[0]);
    EXPECT_GT(std::fabs(shared[1] - own[1]), 1e-9 * std::fabs(own[1]));
}

TEST(FullModel, GradientsWithDistinctMtpLayers) {
    ModelConfig cfg = full_config("cross_entropy", false, true);
    cfg.mtp_use_repeated_layer = false;  // model.layers.2 for depth 1, model.layers.3 for depth 2
    cfg.dsa_mtp_index_kv_share = false;
    check_full_model(cfg);
    cfg = full_config("e2e_tv", true, false);
    cfg.mtp_use_repeated_layer = false;
    cfg.dsa_mtp_index_kv_share = false;
    check_full_model(cfg);
}

// Distinct MTP layers holding the repeated layer's weights compute what the repeated layer does:
// the same losses, and per-layer gradients that sum to the repeated layer's.
TEST(FullModel, DistinctMtpLayersWithEqualWeightsMatchTheRepeatedLayer) {
    for (const char* loss : {"cross_entropy", "e2e_tv"}) {
        ModelConfig rc = full_config(loss, std::string(loss) == "e2e_tv", true);
        rc.mtp_num_layers = 3;
        rc.dsa_mtp_index_kv_share = false;
        ModelConfig dc = rc;
        dc.mtp_use_repeated_layer = false;
        MemoryPlan rplan, dplan;
        Glm5Model<double> rep(rc, rplan, 16, 3, 5), dis(dc, dplan, 16, 3, 5);
        rplan.allocate(Device::CPU);
        dplan.allocate(Device::CPU);
        rep.bind();
        dis.bind();
        rep.params().initialize(rplan, 5, 0.6, rc.num_layers);
        const auto& rp = rep.params().params();
        const auto& dp = dis.params().params();
        ASSERT_GT(dp.size(), rp.size());
        // model.layers.{2,3,4}.X of the distinct model <- model.layers.2.X of the repeated one.
        auto repeated_name = [&](std::string name) {
            for (int j = 1; j < 3; ++j) {
                const std::string from = "model.layers." + std::to_string(2 + j) + ".";
                if (name.rfind(from, 0) == 0) return "model.layers.2." + name.substr(from.size());
            }
            return name;
        };
        auto index_of = [&](const std::string& name) {
            for (size_t i = 0; i < rp.size(); ++i)
                if (rp[i].name == name) return i;
            ADD_FAILURE() << "no " << name;
            return size_t(0);
        };
        std::vector<size_t> src(dp.size());
        for (size_t i = 0; i < dp.size(); ++i) {
            src[i] = index_of(repeated_name(dp[i].name));
            std::copy_n(rep.param(src[i]), dp[i].numel(), dis.param(i));
        }
        EXPECT_EQ(dp.back().name, "model.layers.4.shared_head.norm.weight");
        MicroBatch mb(16, 3);
        mb.add_document({1, 5, 2, 9, 3, 7, 8, 2});
        mb.add_document({4, 4, 7, 10, 0, 6});
        rep.load_inputs(mb);
        dis.load_inputs(mb);
        LossScales sc;
        sc.backward = true;
        sc.lm = 0.37;
        sc.mtp = std::string(loss) == "e2e_tv" ? std::vector<double>{0.8}
                                               : std::vector<double>{0.8, 0.6, 0.4};
        sc.indexer = 1.0;
        sc.aux = 1.0;
        for (size_t i = 0; i < rp.size(); ++i)
            if (rp[i].trainable) std::fill_n(rep.grad(i), rp[i].numel(), 0.0);
        for (size_t i = 0; i < dp.size(); ++i)
            if (dp[i].trainable) std::fill_n(dis.grad(i), dp[i].numel(), 0.0);
        const LossSums r = rep.forward_backward(sc), d = dis.forward_backward(sc);
        EXPECT_DOUBLE_EQ(d.lm_loss_sum, r.lm_loss_sum);
        ASSERT_EQ(d.mtp_sum.size(), r.mtp_sum.size());
        for (size_t k = 0; k < r.mtp_sum.size(); ++k) {
            EXPECT_GT(r.mtp_sum[k], 0.0);
            EXPECT_NEAR(d.mtp_sum[k], r.mtp_sum[k], 1e-12 * r.mtp_sum[k]) << loss << " depth " << k;
        }
        EXPECT_NEAR(d.indexer_loss, r.indexer_loss, 1e-12 * r.indexer_loss);
        EXPECT_NEAR(d.aux_loss, r.aux_loss, 1e-12 * r.aux_loss);
        // Σ over the distinct layers of each gradient element = the repeated layer's.
        std::vector<std::vector<double>> summed(rp.size());
        for (size_t i = 0; i < rp.size(); ++i) summed[i].assign(size_t(rp[i].numel()), 0.0);
        for (size_t i = 0; i < dp.size(); ++i)
            if (dp[i].trainable)
                for (int64_t j = 0; j < dp[i].numel(); ++j)
                    summed[src[i]][size_t(j)] += dis.grad(i)[j];
        int nonzero_distinct = 0;
        for (size_t i = 0; i < dp.size(); ++i)
            if (dp[i].trainable && dp[i].mtp && dp[i].name.rfind("model.layers.4.", 0) == 0)
                for (int64_t j = 0; j < dp[i].numel(); ++j) nonzero_distinct += dis.grad(i)[j] != 0;
        EXPECT_GT(nonzero_distinct, 50);  // the last depth's own layer is trained
        for (size_t i = 0; i < rp.size(); ++i) {
            if (!rp[i].trainable) continue;
            for (int64_t j = 0; j < rp[i].numel(); ++j)
                ASSERT_NEAR(summed[i][size_t(j)], rep.grad(i)[j],
                            1e-10 * std::max(1.0, std::fabs(rep.grad(i)[j])))
                    << loss << " " << rp[i].name << "[" << j << "]";
        }
    }
}

TEST(FullModel, SparseAttentionEqualsDenseWhenTopkCoversEveryKey) {
    // Absorbed sparse MLA over all causal keys must equal the expanded dense form (SPEC §2).
    ModelConfig dense = full_config("cross_entropy", false, true);
    dense.mtp_num_layers = 0;
    dense.moe_layer_pattern = {0, 0};
    dense.experimental_attention_variant = "none";
    ModelConfig sparse = dense;
    sparse.experimental_attention_variant = "dsa";
    sparse.dsa_indexer_topk = 64;
    auto loss = [](const ModelConfig& c) {
        MemoryPlan plan;
        Glm5Model<double> model(c, plan, 16, 3, 16);
        plan.allocate(Device::CPU);
        model.bind();
        model.params().initialize(plan, 5, 0.5, c.num_layers);
        MicroBatch mb(16, 3);
        mb.add_document({1, 5, 2, 9, 3, 7, 8});
        mb.add_document({4, 4, 7, 10, 0, 6});
        model.load_inputs(mb);
        return model.forward_backward(0.0, false).lm_loss_sum;
    };
    EXPECT_NEAR(loss(sparse), loss(dense), 1e-11);
}
