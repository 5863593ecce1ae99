// Muon: Newton-Schulz output band, per-head split = NS of each slice alone, and one full step
// against a PyTorch reference (tools/golden/muon_reference.py).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/model/glm5_model.h"
#include "sparsetron/optim/muon.h"
#include "sparsetron/optim/optimizer.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

// Extreme singular values of x [m, n] from the eigenvalues of the smaller Gram matrix, by power
// iteration (largest) and shifted power iteration (smallest).
std::pair<double, double> singular_range(const std::vector<double>& x, int64_t m, int64_t n) {
    const int64_t r = std::min(m, n);
    std::vector<double> g(r * r, 0.0);
    for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < r; ++j)
            for (int64_t k = 0; k < std::max(m, n); ++k)
                g[i * r + j] += m <= n ? x[i * n + k] * x[j * n + k] : x[k * n + i] * x[k * n + j];
    auto power = [&](double shift) {
        std::vector<double> v(r, 1.0), w(r);
        double lambda = 0;
        for (int it = 0; it < 3000; ++it) {
            double norm = 0;
            for (int64_t i = 0; i < r; ++i) {
                w[i] = -shift * v[i];
                for (int64_t j = 0; j < r; ++j) w[i] += g[i * r + j] * v[j];
                norm += w[i] * w[i];
            }
            norm = std::sqrt(norm);
            for (int64_t i = 0; i < r; ++i) v[i] = w[i] / norm;
            lambda = norm;
        }
        return lambda;
    };
    const double top = power(0.0);
    const double bottom = top - power(top);  // largest of (A - top I) in magnitude is top - min
    return {std::sqrt(std::max(0.0, bottom)), std::sqrt(top)};
}

}  // namespace

TEST(Muon, NewtonSchulzSingularValuesInTheQuinticBand) {
    std::vector<double> ws;
    for (auto [m, n] :
         std::vector<std::pair<int64_t, int64_t>>{{64, 16}, {16, 64}, {48, 48}, {90, 7}}) {
        for (uint64_t seed = 1; seed <= 3; ++seed) {
            auto x = test::random_vector<double>(m * n, seed * 31 + m, 1.0);
            newton_schulz(x.data(), m, n, 5, "quintic", ws);
            auto [lo, hi] = singular_range(x, m, n);
            std::cout << m << "x" << n << " singular values in [" << lo << ", " << hi << "]\n";
            EXPECT_GT(lo, 0.7) << m << "x" << n;
            EXPECT_LT(hi, 1.2) << m << "x" << n;
        }
    }
}

namespace {

struct MuonCase {
    ModelConfig m;
    RunConfig r;
    MemoryPlan plan;
    std::unique_ptr<ParamStore> store;
    std::unique_ptr<Muon> muon;
};

void build(MuonCase& c, const std::vector<std::pair<std::string, std::vector<int64_t>>>& params) {
    c.store = std::make_unique<ParamStore>(c.plan, DType::F64);
    for (const auto& [name, shape] : params) c.store->add(name, shape, InitRule::Normal);
    c.muon = std::make_unique<Muon>(*c.store, c.plan, c.m, c.r);
    c.plan.allocate(Device::CPU);
}

}  // namespace

void one_step_against_reference(const std::string& method);

// Both Newton-Schulz forms: the Gram form (muon_ns_method: gram) equals the standard iteration in
// exact arithmetic, so the fp64 step matches the same reference.
TEST(Muon, OneStepMatchesThePyTorchReference) {
    for (const char* method : {"standard", "gram"}) {
        SCOPED_TRACE(method);
        one_step_against_reference(method);
    }
}

void one_step_against_reference(const std::string& method) {
    nlohmann::json fx;
    std::ifstream(std::string(SPARSETRON_SOURCE_DIR) + "/tests/fixtures/muon/step.json") >> fx;
    const auto& hp = fx["hyper"];
    MuonCase c;
    c.r.muon_ns_method = method;
    c.m.num_attention_heads = hp["heads"];
    c.m.qk_head_dim = hp["nope"];
    c.m.qk_pos_emb_head_dim = hp["rope"];
    c.m.v_head_dim = hp["v"];
    c.r.optimizer = "muon";
    c.r.weight_decay = hp["weight_decay"];
    c.r.muon_momentum = hp["momentum"];
    c.r.muon_nesterov = true;
    c.r.muon_split_qkv_per_head = true;
    c.r.muon_scale_mode = "spectral";
    c.r.muon_extra_scale_factor = hp["extra"];
    std::vector<std::pair<std::string, std::vector<int64_t>>> params;
    for (const char* n : {"q_b_proj", "kv_b_proj", "o_proj"})
        params.push_back({std::string("model.layers.0.self_attn.") + n + ".weight",
                          fx["params"][n]["shape"].get<std::vector<int64_t>>()});
    build(c, params);
    EXPECT_EQ(c.muon->split(0).kind, "per_head");
    EXPECT_EQ(c.muon->split(0).slices.size(), 4u);
    EXPECT_EQ(c.muon->split(2).slices.size(), 1u);  // o_proj is never split
    const char* names[] = {"q_b_proj", "kv_b_proj", "o_proj"};
    for (int i = 0; i < 3; ++i) {
        const auto& p = fx["params"][names[i]];
        auto load = [&](const char* key, MemoryPlan::Slot slot) {
            auto v = p[key].get<std::vector<double>>();
            std::copy(v.begin(), v.end(), c.plan.view(slot).ptr<double>());
        };
        load("w", c.store->params()[i].param_slot);
        load("g", c.store->params()[i].grad_slot);
        load("m", c.muon->momentum_slots()[i]);
    }
    c.muon->step(c.plan, c.r, hp["lr"].get<double>(), 1.0);
    for (int i = 0; i < 3; ++i) {
        const auto& p = fx["params"][names[i]];
        auto w1 = p["w1"].get<std::vector<double>>(), m1 = p["m1"].get<std::vector<double>>();
        const double* w = c.plan.view(c.store->params()[i].param_slot).ptr<double>();
        const double* m = c.plan.view(c.muon->momentum_slots()[i]).ptr<double>();
        for (size_t k = 0; k < w1.size(); ++k) {
            EXPECT_NEAR(w[k], w1[k], 2e-5 * std::max(1.0, std::fabs(w1[k])))
                << names[i] << "[" << k << "]";
            EXPECT_NEAR(m[k], m1[k], 1e-6) << names[i] << "[" << k << "]";
        }
    }
}

TEST(Muon, PerHeadSplitEqualsNewtonSchulzOfEachSliceAlone) {
    MuonCase c;
    c.m.num_attention_heads = 3;
    c.m.qk_head_dim = 5;
    c.m.v_head_dim = 4;
    c.r.optimizer = "muon";
    c.r.weight_decay = 0;
    c.r.muon_momentum = 0;  // the update is NS(G) itself
    c.r.muon_split_qkv_per_head = true;
    c.r.muon_scale_mode = "unit_rms_norm";
    build(c, {{"model.layers.0.self_attn.kv_b_proj.weight", {27, 6}}});
    auto g = test::random_vector<double>(27 * 6, 5);
    std::copy(g.begin(), g.end(), c.plan.view(c.store->params()[0].grad_slot).ptr<double>());
    double* w = c.plan.view(c.store->params()[0].param_slot).ptr<double>();
    std::fill_n(w, 27 * 6, 0.0);
    c.muon->step(c.plan, c.r, 1.0, 1.0);
    std::vector<double> ws;
    for (int64_t h = 0; h < 3; ++h)
        for (auto [b, rows] :
             std::vector<std::pair<int64_t, int64_t>>{{h * 9, 5}, {h * 9 + 5, 4}}) {
            std::vector<double> slice(g.begin() + b * 6, g.begin() + (b + rows) * 6);
            newton_schulz(slice.data(), rows, 6, 5, "quintic", ws);
            const double scale = std::sqrt(double(rows) / 6.0);
            for (int64_t k = 0; k < rows * 6; ++k)
                EXPECT_NEAR(w[b * 6 + k], -scale * slice[k], 1e-12);
        }
    // Without the split the whole matrix is one NS: a different update.
    MuonCase whole;
    whole.m = c.m;
    whole.r = c.r;
    whole.r.muon_split_qkv_per_head = false;
    build(whole, {{"model.layers.0.self_attn.kv_b_proj.weight", {27, 6}}});
    std::copy(g.begin(), g.end(),
              whole.plan.view(whole.store->params()[0].grad_slot).ptr<double>());
    std::fill_n(whole.plan.view(whole.store->params()[0].param_slot).ptr<double>(), 27 * 6, 0.0);
    whole.muon->step(whole.plan, whole.r, 1.0, 1.0);
    EXPECT_GT(
        std::fabs(whole.plan.view(whole.store->params()[0].param_slot).ptr<double>()[0] - w[0]),
        1e-3);
}

TEST(Optimizer, NonFiniteGradientSkipsTheStepUntouched) {
    ModelConfig m;
    RunConfig r;
    r.optimizer = "muon";
    MemoryPlan plan;
    ParamStore store(plan, DType::F64);
    store.add("w", {4, 3}, InitRule::Normal);
    store.add("b", {3}, InitRule::Ones, false);
    Optimizer opt(store, plan, m, r);
    plan.allocate(Device::CPU);
    store.initialize(plan, 1, 0.5, 1);
    const double* w = plan.view(store.params()[0].param_slot).ptr<double>();
    std::vector<double> before(w, w + 12);
    double* g = plan.view(store.params()[0].grad_slot).ptr<double>();
    for (int i = 0; i < 12; ++i) g[i] = 0.1 * i;
    g[5] = std::nan("");
    StepStats st = opt.step(plan, r, 1);
    EXPECT_TRUE(st.skipped);
    EXPECT_EQ(std::vector<double>(w, w + 12), before);
    g[5] = 0.5;
    st = opt.step(plan, r, 1);
    EXPECT_FALSE(st.skipped);
    EXPECT_NE(std::vector<double>(w, w + 12), before);
}

TEST(Optimizer, DetachedMtpParametersFormTheirOwnClippingGroup) {
    ModelConfig m;
    m.mtp_num_layers = 2;
    m.mtp_detach_heads = true;
    RunConfig r;
    MemoryPlan plan;
    ParamStore store(plan, DType::F64);
    store.add("backbone", {2, 2}, InitRule::Normal);
    store.add("mtp", {3}, InitRule::Ones, false);
    store.set_mtp_from(1);
    Optimizer opt(store, plan, m, r);
    plan.allocate(Device::CPU);
    double* g0 = plan.view(store.params()[0].grad_slot).ptr<double>();
    double* g1 = plan.view(store.params()[1].grad_slot).ptr<double>();
    for (int i = 0; i < 4; ++i) g0[i] = 3.0;  // norm 6
    for (int i = 0; i < 3; ++i) g1[i] = 4.0;  // norm sqrt(48)
    StepStats st = opt.step(plan, r, 1);
    EXPECT_DOUBLE_EQ(st.grad_norm, 6.0);
    EXPECT_DOUBLE_EQ(st.grad_norm_mtp, std::sqrt(48.0));
}

// The count `sparsetron train` and `plan` print: every slice of every trainable 2-D parameter
// (a per-head q_b_proj of 2 heads gives 4: each head's qk and rope rows; a 1-D norm weight none),
// nothing without Muon.
TEST(Muon, NewtonSchulzCountOverAModelsParameters) {
    MuonCase c;
    c.m.num_attention_heads = 2, c.m.qk_head_dim = 4, c.m.qk_pos_emb_head_dim = 2;
    c.r.optimizer = "muon";
    c.r.muon_split_qkv_per_head = true;
    build(c, {{"model.layers.0.self_attn.q_b_proj.weight", {12, 6}},
              {"model.layers.0.mlp.down_proj.weight", {8, 40}},
              {"model.layers.0.input_layernorm.weight", {8}}});
    const NewtonSchulzCount n = newton_schulz_count(*c.store, c.m, c.r);
    EXPECT_EQ(n.matrices, int64_t(c.muon->split(0).slices.size()) + 1);
    EXPECT_EQ(c.muon->split(0).slices.size(), 4u);
    // Multiply-adds of 5 steps, 5 (0.75 r^2 c + 0.75 r^3 + r^2 c): [4, 6] twice 1080 each, [2, 6]
    // twice 240 each, [8, 40] 24320; 2 FLOPs each.
    const double standard = 2 * (2 * 1080 + 2 * 240 + 24320);
    EXPECT_NEAR(n.standard_flops, standard, 1e-9 * standard);
    c.r.optimizer = "adam";
    EXPECT_EQ(newton_schulz_count(*c.store, c.m, c.r).matrices, 0);
}
