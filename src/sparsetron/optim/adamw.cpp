#include "sparsetron/optim/adamw.h"

#include <cmath>
#include <cstring>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/optim/optim.h"

namespace sparsetron {

namespace {
template <typename Fn>
void with_type(DType t, Fn&& fn) {
    if (t == DType::F32)
        fn(float{});
    else if (t == DType::F64)
        fn(double{});
    else
        throw Error(cat("optimizer: unsupported parameter dtype ", dtype_name(t)));
}
}  // namespace

AdamW::AdamW(const ParamStore& store, MemoryPlan& plan, std::vector<bool> handles) : store_(store) {
    const auto& params = store.params();
    for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        const bool mine = p.trainable && (handles.empty() || handles[i]);
        m_.push_back(
            mine ? plan.add(MemClass::OptimizerState, p.name + ".exp_avg", store.dtype(), p.shape)
                 : -1);
        v_.push_back(mine ? plan.add(MemClass::OptimizerState, p.name + ".exp_avg_sq",
                                     store.dtype(), p.shape)
                          : -1);
    }
}

void grad_sum_squares(const ParamStore& store, const MemoryPlan& plan,
                      const std::vector<int>& bucket, double* sums) {
    with_type(store.dtype(), [&](auto zero) {
        using T = decltype(zero);
        const auto& params = store.params();
        for (size_t i = 0; i < params.size(); ++i)
            if (params[i].trainable && bucket[i] >= 0)
                sums[bucket[i]] +=
                    cpu::sum_squares(plan.view(params[i].grad_slot).ptr<T>(), params[i].numel());
    });
}

void zero_grads(const MemoryPlan& plan) {
    std::memset(plan.class_base(MemClass::Gradients), 0, plan.class_bytes(MemClass::Gradients));
}

void AdamW::step(const MemoryPlan& plan, const RunConfig& run, int64_t step, double lr,
                 const std::vector<double>& grad_scale, const std::vector<bool>* update) const {
    with_type(store_.dtype(), [&](auto zero) {
        using T = decltype(zero);
        const auto& params = store_.params();
        for (size_t i = 0; i < params.size(); ++i) {
            const auto& p = params[i];
            if (m_[i] < 0 || (update && !(*update)[i])) continue;
            cpu::adamw_update(plan.view(p.param_slot).ptr<T>(), plan.view(p.grad_slot).ptr<T>(),
                              plan.view(m_[i]).ptr<T>(), plan.view(v_[i]).ptr<T>(), p.numel(), lr,
                              run.adam_beta1, run.adam_beta2, run.adam_eps,
                              p.weight_decay ? run.weight_decay : 0.0, step, grad_scale[i]);
        }
    });
}

}  // namespace sparsetron
