#include "sparsetron/optim/adamw.h"

#include <cmath>
#include <cstring>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/cpu/kernels.h"
#include "sparsetron/optim/lr_schedule.h"

namespace sparsetron {

AdamW::AdamW(const ParamStore& store, MemoryPlan& plan) : store_(store) {
    for (const auto& p : store.params()) {
        if (!p.trainable) {  // buffers (the MoE expert bias) have no optimizer state
            m_.push_back(-1), v_.push_back(-1);
            continue;
        }
        m_.push_back(
            plan.add(MemClass::OptimizerState, p.name + ".exp_avg", store.dtype(), p.shape));
        v_.push_back(
            plan.add(MemClass::OptimizerState, p.name + ".exp_avg_sq", store.dtype(), p.shape));
    }
}

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

double global_grad_norm(const ParamStore& store, const MemoryPlan& plan,
                        const std::vector<bool>* only) {
    double ss = 0;
    with_type(store.dtype(), [&](auto zero) {
        using T = decltype(zero);
        const auto& params = store.params();
        for (size_t i = 0; i < params.size(); ++i)
            if (params[i].trainable && (!only || (*only)[i]))
                ss += cpu::sum_squares(plan.view(params[i].grad_slot).ptr<T>(), params[i].numel());
    });
    return std::sqrt(ss);
}

void zero_grads(const MemoryPlan& plan) {
    std::memset(plan.class_base(MemClass::Gradients), 0, plan.class_bytes(MemClass::Gradients));
}

StepStats AdamW::step(const MemoryPlan& plan, const RunConfig& run, int64_t step,
                      const std::vector<bool>* update) const {
    StepStats st;
    st.lr = learning_rate(run, step);
    st.grad_norm = global_grad_norm(store_, plan, update);
    if (!std::isfinite(st.grad_norm)) {
        st.skipped = true;
        return st;
    }
    if (run.clip_grad > 0 && st.grad_norm > run.clip_grad)
        st.clip_scale = run.clip_grad / (st.grad_norm + 1e-6);
    with_type(store_.dtype(), [&](auto zero) {
        using T = decltype(zero);
        const auto& params = store_.params();
        for (size_t i = 0; i < params.size(); ++i) {
            const auto& p = params[i];
            if (!p.trainable || (update && !(*update)[i])) continue;
            cpu::adamw_update(plan.view(p.param_slot).ptr<T>(), plan.view(p.grad_slot).ptr<T>(),
                              plan.view(m_[i]).ptr<T>(), plan.view(v_[i]).ptr<T>(), p.numel(),
                              st.lr, run.adam_beta1, run.adam_beta2, run.adam_eps,
                              p.weight_decay ? run.weight_decay : 0.0, step, st.clip_scale);
        }
    });
    return st;
}

}  // namespace sparsetron
