// The whole model slice: fp64 gradient check of every parameter, fp32 vs fp64 agreement, and
// document isolation in packed micro-batches.
#include <gtest/gtest.h>

#include <cmath>

#include "sparsetron/model/glm5_model.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

ModelConfig micro_config(bool interleaved) {
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
    m.rotary_interleaved = interleaved;
    m.moe_layer_pattern.assign(m.num_layers, 0);
    m.experimental_attention_variant = "none";  // the dense slice: expanded MLA, dense SwiGLU
    m.mtp_num_layers = 0;
    return m;
}

MicroBatch two_documents() {
    MicroBatch mb(12, 3);
    mb.add_document({1, 5, 2, 9, 3});
    mb.add_document({4, 4, 7, 10, 0, 6});
    return mb;  // one padding slot
}

template <typename T>
struct Harness {
    MemoryPlan plan;
    Glm5Model<T> model;
    Harness(const ModelConfig& m, int64_t tokens, int64_t docs, int64_t chunk)
        : model(m, plan, tokens, docs, chunk) {
        plan.allocate(Device::CPU);
        model.bind();
        // Init larger than training's 0.02 so every path carries signal in the check.
        model.params().initialize(plan, 7, 0.5, m.num_layers);
        // Norm weights away from 1 so their gradients are not a special case.
        for (size_t i = 0; i < model.params().params().size(); ++i) {
            const auto& p = model.params().params()[i];
            if (p.shape.size() == 1)
                for (int64_t j = 0; j < p.numel(); ++j)
                    model.param(i)[j] = T(1.0 + 0.1 * ((j % 5) - 2));
        }
    }
};

}  // namespace

TEST(Model, EveryParameterGradientMatchesFiniteDifferences) {
    for (bool interleaved : {true, false}) {
        ModelConfig cfg = micro_config(interleaved);
        Harness<double> h(cfg, 12, 3, 5);
        MicroBatch mb = two_documents();
        h.model.load_inputs(mb);
        const auto& params = h.model.params().params();
        for (size_t i = 0; i < params.size(); ++i)
            std::fill_n(h.model.grad(i), params[i].numel(), 0.0);
        LossSums base = h.model.forward_backward(1.0, true);
        EXPECT_EQ(base.lm_targets, 9);
        const double eps = 1e-5;
        for (size_t i = 0; i < params.size(); ++i) {
            const int64_t n = params[i].numel();
            // Up to 8 elements per tensor, spread over it.
            for (int64_t s = 0; s < std::min<int64_t>(8, n); ++s) {
                int64_t j = (s * 7919) % n;
                double* w = h.model.param(i) + j;
                double keep = *w;
                *w = keep + eps;
                double up = h.model.forward_backward(0.0, false).lm_loss_sum;
                *w = keep - eps;
                double down = h.model.forward_backward(0.0, false).lm_loss_sum;
                *w = keep;
                double fd = (up - down) / (2 * eps);
                double an = h.model.grad(i)[j];
                EXPECT_NEAR(an, fd, 1e-6 * std::max(1.0, std::fabs(fd)))
                    << params[i].name << "[" << j << "] interleaved=" << interleaved;
            }
        }
    }
}

TEST(Model, Fp32AgreesWithFp64) {
    ModelConfig cfg = micro_config(true);
    Harness<double> d(cfg, 12, 3, 4);
    Harness<float> f(cfg, 12, 3, 4);
    MicroBatch mb = two_documents();
    d.model.load_inputs(mb);
    f.model.load_inputs(mb);
    double ld = d.model.forward_backward(0.0, false).lm_loss_sum;
    double lf = f.model.forward_backward(0.0, false).lm_loss_sum;
    EXPECT_NEAR(lf, ld, 1e-5 * std::fabs(ld));
    EXPECT_GT(std::fabs(ld), 1.0);
}

TEST(Model, PackedDocumentsDoNotSeeEachOther) {
    ModelConfig cfg = micro_config(false);
    Harness<double> h(cfg, 12, 3, 12);
    MicroBatch both = two_documents();
    MicroBatch a(12, 3), b(12, 3);
    a.add_document({1, 5, 2, 9, 3});
    b.add_document({4, 4, 7, 10, 0, 6});
    auto loss = [&](const MicroBatch& mb) {
        h.model.load_inputs(mb);
        return h.model.forward_backward(0.0, false).lm_loss_sum;
    };
    EXPECT_NEAR(loss(both), loss(a) + loss(b), 1e-12);
}

// MTP's inputs and targets in a packed micro-batch stay inside each document, as Megatron rolls
// them per packed sequence: depth k reads the token k ahead and predicts the one k + 1 ahead,
// -1 where the document ends first (a one-token document has none), the padding none at all.
TEST(Model, MtpTargetsStopAtDocumentBoundaries) {
    ModelConfig cfg = micro_config(true);
    cfg.mtp_num_layers = 3;
    Harness<float> h(cfg, 12, 4, 5);
    MicroBatch mb(12, 4);
    mb.add_document({1, 2, 3, 4, 5});
    mb.add_document({6});
    mb.add_document({7, 8, 9, 10});
    h.model.load_inputs(mb);  // rows 10 and 11: padding
    using V = std::vector<int32_t>;
    const V lm = {2, 3, 4, 5, -1, -1, 8, 9, 10, -1, -1, -1};
    EXPECT_EQ(mb.targets, lm);
    const V ids[3] = {{2, 3, 4, 5, -1, -1, 8, 9, 10, -1, -1, -1},
                      {3, 4, 5, -1, -1, -1, 9, 10, -1, -1, -1, -1},
                      {4, 5, -1, -1, -1, -1, 10, -1, -1, -1, -1, -1}};
    const V targets[3] = {{3, 4, 5, -1, -1, -1, 9, 10, -1, -1, -1, -1},
                          {4, 5, -1, -1, -1, -1, 10, -1, -1, -1, -1, -1},
                          {5, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}};
    for (int64_t k = 1; k <= 3; ++k) {
        EXPECT_EQ(V(h.model.mtp_ids(k), h.model.mtp_ids(k) + 12), ids[k - 1]) << "depth " << k;
        EXPECT_EQ(V(h.model.mtp_targets(k), h.model.mtp_targets(k) + 12), targets[k - 1])
            << "depth " << k;
    }
}
