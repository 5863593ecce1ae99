#include "sparsetron/optim/optimizer.h"

#include <cmath>
#include <iomanip>
#include <sstream>

#include "sparsetron/optim/lr_schedule.h"

namespace sparsetron {

Optimizer::Optimizer(const ParamStore& store, MemoryPlan& plan, const ModelConfig& m,
                     const RunConfig& r)
    : store_(store) {
    const bool muon = r.optimizer == "muon";
    std::vector<bool> adam_handles;
    for (const auto& p : store.params()) {
        uses_muon_.push_back(muon && is_muon_param(p));
        adam_handles.push_back(p.trainable && !uses_muon_.back());
        mtp_group_.push_back(p.mtp);
    }
    adamw_ = std::make_unique<AdamW>(store, plan, adam_handles);
    if (muon) muon_ = std::make_unique<Muon>(store, plan, m, r);
    separate_mtp_ = m.mtp_num_layers > 0 && m.mtp_detach_heads;
}

StepStats Optimizer::step(const MemoryPlan& plan, const RunConfig& run, int64_t step,
                          const std::vector<bool>* update, const std::vector<bool>* owned) {
    StepStats st;
    st.lr = learning_rate(run, step);
    const size_t n = store_.params().size();
    std::vector<bool> main(n), mtp(n, false);
    for (size_t i = 0; i < n; ++i) {
        const bool selected = !update || (*update)[i];
        mtp[i] = selected && separate_mtp_ && mtp_group_[i];
        main[i] = selected && !mtp[i];
    }
    // Squared norms [main dense, MTP dense, main experts, MTP experts]; the routed experts'
    // (sharded over EP) summed over the EP group.
    std::vector<int> bucket(n, -1);
    for (size_t i = 0; i < n; ++i)
        if ((main[i] || mtp[i]) && !store_.params()[i].pipeline_copy)
            bucket[i] = (store_.params()[i].routed_expert ? 2 : 0) + int(mtp[i]);
    double ss[4] = {0, 0, 0, 0};
    grad_sum_squares(store_, plan, bucket, ss);
    if (ep_) ep_->allreduce_sum(ss + 2, 2);
    if (pp_) pp_->allreduce_sum(ss, 4);
    st.grad_norm = std::sqrt(ss[0] + ss[2]);
    if (separate_mtp_) st.grad_norm_mtp = std::sqrt(ss[1] + ss[3]);
    if (!std::isfinite(st.grad_norm) || !std::isfinite(st.grad_norm_mtp)) {
        st.skipped = true;
        return st;
    }
    auto clip = [&](double norm) {
        return run.clip_grad > 0 && norm > run.clip_grad ? run.clip_grad / (norm + 1e-6) : 1.0;
    };
    const double main_scale = clip(st.grad_norm), mtp_scale = clip(st.grad_norm_mtp);
    std::vector<double> scale(n);
    for (size_t i = 0; i < n; ++i) scale[i] = mtp[i] ? mtp_scale : main_scale;
    std::vector<bool> apply(n);
    for (size_t i = 0; i < n; ++i) apply[i] = (main[i] || mtp[i]) && (!owned || (*owned)[i]);
    adamw_->step(plan, run, step, st.lr, scale, &apply);
    if (muon_) {
        // Muon takes one clipping factor per call: run the groups separately.
        std::vector<bool> only_main(n), only_mtp(n);
        for (size_t i = 0; i < n; ++i)
            only_main[i] = main[i] && apply[i], only_mtp[i] = mtp[i] && apply[i];
        muon_->step(plan, run, st.lr, main_scale, &only_main);
        if (separate_mtp_) muon_->step(plan, run, st.lr, mtp_scale, &only_mtp);
    }
    return st;
}

std::vector<std::pair<std::string, MemoryPlan::Slot>> Optimizer::state_tensors() const {
    std::vector<std::pair<std::string, MemoryPlan::Slot>> out;
    const auto& params = store_.params();
    for (size_t i = 0; i < params.size(); ++i) {
        if (adamw_->exp_avg_slots()[i] >= 0) {
            out.emplace_back(params[i].name + ".exp_avg", adamw_->exp_avg_slots()[i]);
            out.emplace_back(params[i].name + ".exp_avg_sq", adamw_->exp_avg_sq_slots()[i]);
        }
        if (muon_ && muon_->momentum_slots()[i] >= 0)
            out.emplace_back(params[i].name + ".momentum_buffer", muon_->momentum_slots()[i]);
    }
    return out;
}

std::string Optimizer::describe(const MemoryPlan& plan) const {
    std::ostringstream os;
    const auto& params = store_.params();
    os << std::left << std::setw(58) << "parameter" << std::setw(18) << "shape" << std::setw(8)
       << "optim" << std::setw(22) << "split"
       << "state\n";
    for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        std::string shape, optim = "-", split = "-";
        for (size_t d = 0; d < p.shape.size(); ++d) {
            if (d) shape += 'x';
            shape += std::to_string(p.shape[d]);
        }
        size_t state = 0;
        if (uses_muon_[i]) {
            optim = "muon";
            const MuonSplit& s = muon_->split(static_cast<int64_t>(i));
            split = s.kind == "none" ? "whole" : s.kind + " x" + std::to_string(s.slices.size());
            state = plan.entries()[muon_->momentum_slots()[i]].bytes;
        } else if (adamw_->exp_avg_slots()[i] >= 0) {
            optim = "adamw";
            state = plan.entries()[adamw_->exp_avg_slots()[i]].bytes * 2;
        } else if (!p.trainable) {
            optim = "buffer";
        }
        os << std::left << std::setw(58) << p.name << std::setw(18) << shape << std::setw(8)
           << optim << std::setw(22) << split << format_bytes(double(state)) << "\n";
    }
    return os.str();
}

}  // namespace sparsetron
