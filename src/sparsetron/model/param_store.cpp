#include "sparsetron/model/param_store.h"

#include <cmath>

#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/core/thread_pool.h"

namespace sparsetron {

int64_t ParamInfo::numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
}

int64_t ParamStore::push(ParamInfo p) {
    ST_ASSERT(index_of(p.name) < 0, "parameter '", p.name, "' registered twice");
    if (plan_values_) p.param_slot = plan_.add(MemClass::Parameters, p.name, dtype_, p.shape);
    if (p.trainable)
        p.grad_slot = plan_.add(MemClass::Gradients, p.name + ".grad",
                                p.grad_bf16 ? DType::BF16 : dtype_, p.shape);
    index_.emplace(p.name, int64_t(params_.size()));
    params_.push_back(std::move(p));
    return static_cast<int64_t>(params_.size()) - 1;
}

int64_t ParamStore::add(std::string name, std::vector<int64_t> shape, InitRule init, bool decay) {
    ParamInfo p;
    p.name = std::move(name);
    p.group = shape.size() == 2 ? OptimGroup::Muon : OptimGroup::AdamW;
    p.shape = std::move(shape);
    p.weight_decay = decay;
    p.init = init;
    return push(std::move(p));
}

int64_t ParamStore::add_embedding_like(std::string name, std::vector<int64_t> shape) {
    int64_t i = add(std::move(name), std::move(shape), InitRule::Normal, true);
    params_[i].group = OptimGroup::AdamW;
    return i;
}

int64_t ParamStore::add_buffer(std::string name, std::vector<int64_t> shape, InitRule init) {
    ParamInfo p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.group = OptimGroup::None;
    p.trainable = false;
    p.weight_decay = false;
    p.init = init;
    return push(std::move(p));
}

int64_t ParamStore::add_like(const ParamInfo& other, bool grad_bf16) {
    ParamInfo p = other;
    p.param_slot = p.grad_slot = -1;
    p.grad_bf16 = grad_bf16 && p.trainable;
    return push(std::move(p));
}

void ParamStore::plan_value(int64_t i, MemClass where) {
    ParamInfo& p = params_[size_t(i)];
    ST_ASSERT(p.param_slot < 0, "parameter '", p.name, "': its value is already planned");
    p.param_slot = plan_.add(where, p.name, dtype_, p.shape);
}

void ParamStore::set_mtp_from(int64_t first) {
    for (size_t i = static_cast<size_t>(first); i < params_.size(); ++i) params_[i].mtp = true;
}

void ParamStore::mark_pipeline_copy(int64_t index) {
    ST_ASSERT(index >= 0 && index < size(), "parameter index ", index);
    params_[size_t(index)].pipeline_copy = true;
}

void ParamStore::set_routed_expert_from(int64_t first) {
    for (size_t i = static_cast<size_t>(first); i < params_.size(); ++i)
        params_[i].routed_expert = true;
}

const ParamInfo& ParamStore::at(const std::string& name) const {
    int64_t i = index_of(name);
    ST_CHECK(i >= 0, "no parameter named '", name, "'");
    return params_[i];
}

int64_t ParamStore::index_of(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? -1 : it->second;
}

int64_t ParamStore::index(const std::string& name) const {
    const int64_t i = index_of(name);
    ST_ASSERT(i >= 0, "no parameter named '", name, "' in the parameter table");
    return i;
}

int64_t ParamStore::total_numel(bool trainable_only) const {
    int64_t n = 0;
    for (const auto& p : params_)
        if (p.trainable || !trainable_only) n += p.numel();
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
