#include "sparsetron/runtime/gpu/gpu_optimizer.h"

#include <algorithm>
#include <cmath>

#include "sparsetron/optim/lr_schedule.h"

namespace sparsetron::gpu {

GpuOptimizer::GpuOptimizer(const GpuParams& P, MemoryPlan& plan, const ModelConfig& m,
                           const RunConfig& r)
    : P_(P), cfg_(m) {
    const auto& params = P.store().params();
    muon_ = r.optimizer == "muon";
    separate_mtp_ = m.mtp_num_layers > 0 && m.mtp_detach_heads;
    int64_t off = 0, max_numel = 0, max_r = 0;
    bool seen_mtp = false;
    parts_main_ = -1;
    for (const auto& p : params) {
        const bool muon = muon_ && p.trainable && p.group == OptimGroup::Muon;
        uses_muon_.push_back(muon);
        const bool adam = p.trainable && !muon;
        m_slots_.push_back(
            adam ? plan.add(MemClass::OptimizerState, p.name + ".exp_avg", DType::F32, p.shape)
                 : -1);
        v_slots_.push_back(
            adam ? plan.add(MemClass::OptimizerState, p.name + ".exp_avg_sq", DType::F32, p.shape)
                 : -1);
        mom_slots_.push_back(muon ? plan.add(MemClass::OptimizerState, p.name + ".momentum_buffer",
                                             DType::F32, p.shape)
                                  : -1);
        splits_.push_back(muon ? muon_split_for(p, m, r) : MuonSplit{});
        if (muon) {
            max_numel = std::max(max_numel, p.numel());
            for (const auto& s : splits_.back().slices)
                max_r = std::max(max_r, std::min(s.num_rows(), p.shape[1]));
        }
        if (separate_mtp_ && p.mtp && !seen_mtp) parts_main_ = off, seen_mtp = true;
        ST_CHECK(!(separate_mtp_ && seen_mtp && !p.mtp), "optimizer: parameter '", p.name,
                 "' follows the MTP layer's; the MTP clipping group must be the last");
        part_off_.push_back(off);
        if (p.trainable) off += cuda::sum_squares_blocks(p.numel());
    }
    parts_total_ = off;
    if (parts_main_ < 0) parts_main_ = parts_total_;
    s_parts_ = plan.add(MemClass::Workspace, "optim.grad_norm_partials", DType::F32,
                        {std::max<int64_t>(parts_total_, 1)});
    s_norm_ = plan.add(MemClass::Workspace, "optim.grad_norms", DType::F32, {2});
    s_scale_ = plan.add(MemClass::Workspace, "optim.clip_scales", DType::F32, {2});
    s_skip_ = plan.add(MemClass::Workspace, "optim.skip", DType::I32, {2});
    // Newton-Schulz workspace: X, its transpose, a copy, A, A^2, B, norm partials and scalars.
    ns_floats_ =
        muon_ ? 3 * max_numel + 3 * max_r * max_r + cuda::sum_squares_blocks(max_numel) + 8 : 1;
    s_ns_ = plan.add(MemClass::Workspace, "optim.newton_schulz", DType::F32, {ns_floats_});
    s_sched_ = plan.add(MemClass::Workspace, "optim.schedule", DType::F32, {3});
}

void GpuOptimizer::bind(const MemoryPlan& plan) {
    auto F = [&](MemoryPlan::Slot s) { return s < 0 ? nullptr : plan.view(s).ptr<float>(); };
    m_.clear(), v_.clear(), mom_.clear();
    for (size_t i = 0; i < m_slots_.size(); ++i) {
        m_.push_back(F(m_slots_[i]));
        v_.push_back(F(v_slots_[i]));
        mom_.push_back(F(mom_slots_[i]));
    }
    parts_ = F(s_parts_), norm_ = F(s_norm_), scale_ = F(s_scale_), ns_ = F(s_ns_);
    sched_ = F(s_sched_);
    skip_ = plan.view(s_skip_).ptr<int32_t>();
}

void GpuOptimizer::stage_schedule(const ExecContext& ctx, const RunConfig& run, int64_t step) {
    const float sched[3] = {float(learning_rate(run, step)),
                            float(1.0 - std::pow(double(float(run.adam_beta1)), double(step))),
                            float(1.0 - std::pow(double(float(run.adam_beta2)), double(step)))};
    cuda::upload(ctx, sched_, sched, sizeof(sched));
}

void GpuOptimizer::enqueue_step(const ExecContext& ctx, const RunConfig& run) {
    const auto& params = P_.store().params();
    for (size_t i = 0; i < params.size(); ++i)
        if (params[i].trainable)
            cuda::sum_squares_partials(ctx, P_[int64_t(i)].grad, P_[int64_t(i)].numel,
                                       parts_ + part_off_[i]);
    const float clip = float(run.clip_grad);
    cuda::clip_scale(ctx, parts_, parts_main_, clip, norm_, scale_, skip_);
    if (separate_mtp_) {
        cuda::clip_scale(ctx, parts_ + parts_main_, parts_total_ - parts_main_, clip, norm_ + 1,
                         scale_ + 1, skip_ + 1);
        cuda::merge_skip(ctx, skip_, 2);
    }
    if (veto_) cuda::veto_skip(ctx, skip_, separate_mtp_ ? 2 : 1, veto_);
    for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        if (!p.trainable) continue;
        const int g = separate_mtp_ && p.mtp ? 1 : 0;
        const GpuParam& gp = P_[int64_t(i)];
        if (uses_muon_[i]) {
            muon_update(ctx, run, i, scale_ + g, skip_ + g);
            cuda::f32_to_bf16(ctx, gp.master, gp.w, gp.numel);
        } else {
            cuda::adamw_update(ctx, gp.master, gp.grad, m_[i], v_[i], gp.numel, 0.f,
                               float(run.adam_beta1), float(run.adam_beta2), float(run.adam_eps),
                               p.weight_decay ? float(run.weight_decay) : 0.f, 1, scale_ + g,
                               skip_ + g, gp.w, sched_);
        }
    }
}

StepStats GpuOptimizer::read_stats(const ExecContext& ctx, const RunConfig& run,
                                   int64_t step) const {
    StepStats st;
    st.lr = learning_rate(run, step);
    float norms[2] = {0, 0};
    int32_t skip = 0;
    cuda::download(ctx, norms, norm_, separate_mtp_ ? 2 * sizeof(float) : sizeof(float));
    cuda::download(ctx, &skip, skip_, sizeof(int32_t));
    st.grad_norm = norms[0];
    st.grad_norm_mtp = separate_mtp_ ? norms[1] : 0.0;
    st.skipped = skip != 0;
    return st;
}

void GpuOptimizer::muon_update(const ExecContext& ctx, const RunConfig& r, size_t i,
                               const float* scale, const int32_t* skip) {
    const ParamInfo& p = P_.store().params()[i];
    const GpuParam& gp = P_[int64_t(i)];
    const int64_t cols = p.shape[1];
    const float beta = float(r.muon_momentum);
    // Decoupled decay 1 - lr wd from the staged learning rate.
    cuda::muon_momentum(ctx, gp.master, gp.grad, mom_[i], gp.numel, 1.f, beta, scale, skip, sched_,
                        p.weight_decay ? float(r.weight_decay) : 0.f);
    for (const MuonSlice& s : splits_[i].slices) {
        const int64_t rows = s.num_rows();
        float* X = ns_;
        int64_t at = 0;
        for (auto [b, e] : s.rows) {
            cuda::muon_gather(ctx, gp.grad, mom_[i], cols, b, e - b, beta, r.muon_nesterov, scale,
                              X, at);
            at += e - b;
        }
        // Newton-Schulz on the wide orientation [rr, cc], rr <= cc.
        const bool tr = rows > cols;
        const int64_t rr = tr ? cols : rows, cc = tr ? rows : cols, n = rows * cols;
        float* W = ns_ + n;  // the working matrix (X or its transpose)
        float* Y = W + n;    // a copy for X <- B X + a X
        float* A = Y + n;
        float* AA = A + rr * rr;
        float* B = AA + rr * rr;
        float* parts = B + rr * rr;
        float* scal = parts + cuda::sum_squares_blocks(n);  // norm, scale, skip (unused)
        if (tr)
            cuda::transpose(ctx, X, rows, cols, W);
        else
            cuda::copy_2d(ctx, W, n * 4, X, n * 4, n * 4, 1);
        cuda::sum_squares_partials(ctx, W, n, parts);
        cuda::clip_scale(ctx, parts, cuda::sum_squares_blocks(n), 0.f, scal, scal + 1,
                         reinterpret_cast<int32_t*>(scal + 2));
        cuda::scale_by_inverse_norm(ctx, W, n, scal, 1e-7f);
        const auto F32 = DType::F32;
        // muon_fp32_matmul_prec (PyTorch's float32 matmul precision): "highest" keeps true fp32,
        // "high"/"medium" allow TF32 tensor cores, as the seed's Muon does.
        cuda::GemmBatch one;
        one.tf32 = r.muon_fp32_matmul_prec != "highest";
        for (int64_t k = 0; k < r.muon_num_ns_steps; ++k) {
            const MuonCoefficients c = muon_ns_coefficients(r.muon_coefficient_type, k);
            cuda::gemm(ctx, false, true, rr, rr, cc, 1.f, W, cc, W, cc, 0.f, A, rr, F32, F32, one);
            cuda::gemm(ctx, false, false, rr, rr, rr, 1.f, A, rr, A, rr, 0.f, AA, rr, F32, F32,
                       one);
            cuda::axpby(ctx, A, AA, float(c.b), float(c.c), rr * rr, B);
            cuda::copy_2d(ctx, Y, n * 4, W, n * 4, n * 4, 1);
            cuda::gemm(ctx, false, false, rr, cc, rr, 1.f, B, rr, Y, cc, float(c.a), W, cc, F32,
                       F32, one);
        }
        if (tr)
            cuda::transpose(ctx, W, rr, cc, X);
        else
            X = W;
        // The step is lr (staged on the device) times the shape scale.
        const float factor =
            float(muon_scale(rows, cols, r.muon_scale_mode) * r.muon_extra_scale_factor);
        at = 0;
        for (auto [b, e] : s.rows) {
            cuda::muon_apply(ctx, gp.master, X, cols, b, e - b, at, factor, skip, sched_);
            at += e - b;
        }
    }
}

std::vector<std::pair<std::string, MemoryPlan::Slot>> GpuOptimizer::state_tensors() const {
    std::vector<std::pair<std::string, MemoryPlan::Slot>> out;
    const auto& params = P_.store().params();
    for (size_t i = 0; i < params.size(); ++i) {
        if (m_slots_[i] >= 0) {
            out.emplace_back(params[i].name + ".exp_avg", m_slots_[i]);
            out.emplace_back(params[i].name + ".exp_avg_sq", v_slots_[i]);
        }
        if (mom_slots_[i] >= 0)
            out.emplace_back(params[i].name + ".momentum_buffer", mom_slots_[i]);
    }
    return out;
}

}  // namespace sparsetron::gpu
