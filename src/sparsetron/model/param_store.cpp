#include "sparsetron/model/param_store.h"

#include <cmath>

#include "sparsetron/core/error.h"
#include "sparsetron/core/parallel.h"
#include "sparsetron/core/rng.h"

namespace sparsetron {

int64_t ParamInfo::numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
}

ParamStore::ParamStore(const ModelConfig& m, MemoryPlan& plan, DType dtype)
    : plan_(plan), dtype_(dtype) {
    const int64_t h = m.hidden_size, H = m.num_attention_heads;
    add("model.embed_tokens.weight", {m.vocab_size, h}, InitRule::Normal, OptimGroup::AdamW, true);
    for (int64_t l = 0; l < m.num_layers; ++l) {
        const std::string p = cat("model.layers.", l, ".");
        add(p + "input_layernorm.weight", {h}, InitRule::Ones, OptimGroup::AdamW, false);
        add(p + "self_attn.q_a_proj.weight", {m.q_lora_rank, h}, InitRule::Normal, OptimGroup::Muon,
            true);
        add(p + "self_attn.q_a_layernorm.weight", {m.q_lora_rank}, InitRule::Ones,
            OptimGroup::AdamW, false);
        add(p + "self_attn.q_b_proj.weight", {H * m.q_head_dim(), m.q_lora_rank}, InitRule::Normal,
            OptimGroup::Muon, true);
        add(p + "self_attn.kv_a_proj_with_mqa.weight", {m.kv_lora_rank + m.qk_pos_emb_head_dim, h},
            InitRule::Normal, OptimGroup::Muon, true);
        add(p + "self_attn.kv_a_layernorm.weight", {m.kv_lora_rank}, InitRule::Ones,
            OptimGroup::AdamW, false);
        add(p + "self_attn.kv_b_proj.weight", {H * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank},
            InitRule::Normal, OptimGroup::Muon, true);
        add(p + "self_attn.o_proj.weight", {h, H * m.v_head_dim}, InitRule::ScaledNormal,
            OptimGroup::Muon, true);
        add(p + "post_attention_layernorm.weight", {h}, InitRule::Ones, OptimGroup::AdamW, false);
        ST_CHECK(!m.is_moe_layer(l), "layer ", l,
                 " is an MoE layer; MoE layers are not implemented yet (CPU dense slice only)");
        add(p + "mlp.gate_proj.weight", {m.ffn_hidden_size, h}, InitRule::Normal, OptimGroup::Muon,
            true);
        add(p + "mlp.up_proj.weight", {m.ffn_hidden_size, h}, InitRule::Normal, OptimGroup::Muon,
            true);
        add(p + "mlp.down_proj.weight", {h, m.ffn_hidden_size}, InitRule::ScaledNormal,
            OptimGroup::Muon, true);
    }
    add("model.norm.weight", {h}, InitRule::Ones, OptimGroup::AdamW, false);
    add("lm_head.weight", {m.vocab_size, h}, InitRule::Normal, OptimGroup::AdamW, true);
}

void ParamStore::add(std::string name, std::vector<int64_t> shape, InitRule init, OptimGroup group,
                     bool decay) {
    ParamInfo p;
    p.name = std::move(name);
    p.shape = shape;
    p.group = group;
    p.weight_decay = decay;
    p.init = init;
    p.param_slot = plan_.add(MemClass::Parameters, p.name, dtype_, shape);
    p.grad_slot = plan_.add(MemClass::Gradients, p.name + ".grad", dtype_, shape);
    params_.push_back(std::move(p));
}

const ParamInfo& ParamStore::at(const std::string& name) const {
    int64_t i = index_of(name);
    ST_CHECK(i >= 0, "no parameter named '", name, "'");
    return params_[i];
}

int64_t ParamStore::index_of(const std::string& name) const {
    for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i].name == name) return static_cast<int64_t>(i);
    return -1;
}

int64_t ParamStore::total_numel() const {
    int64_t n = 0;
    for (const auto& p : params_) n += p.numel();
    return n;
}

void ParamStore::initialize(const MemoryPlan& plan, uint64_t seed, double std,
                            int64_t num_layers) const {
    for (const auto& p : params_) {
        Tensor t = plan.view(p.param_slot);
        ST_ASSERT(t.device == Device::CPU, "initialize on host memory");
        CounterRng rng(seed, hash_name(p.name.c_str()));
        double s = p.init == InitRule::ScaledNormal ? std / std::sqrt(2.0 * num_layers) : std;
        int64_t n = p.numel();
        auto fill = [&](auto* x) {
            parallel_for(
                n,
                [&](int64_t b, int64_t e) {
                    for (int64_t i = b; i < e; ++i) {
                        double v = p.init == InitRule::Ones ? 1.0
                                   : p.init == InitRule::Zeros
                                       ? 0.0
                                       : s * rng.normal(static_cast<uint64_t>(i));
                        x[i] = static_cast<std::remove_pointer_t<decltype(x)>>(v);
                    }
                },
                4096);
        };
        if (t.dtype == DType::F32)
            fill(t.ptr<float>());
        else
            fill(t.ptr<double>());
    }
}

}  // namespace sparsetron
