#include "sparsetron/model/cuda/cuda_common.h"

#include <cstring>
#include "sparsetron/ops/copy/copy.h"

namespace sparsetron::cuda {

void CudaParams::plan_bf16(MemoryPlan& plan, const std::vector<int64_t>& unread) {
    ST_CHECK(store_.dtype() == DType::F32, "the CUDA model keeps fp32 masters");
    ST_CHECK(bf16_slots_.empty(), "CudaParams: the bf16 copies are already planned");
    std::vector<bool> skip(store_.params().size(), false);
    for (const int64_t i : unread) skip[size_t(i)] = true;
    for (size_t i = 0; i < store_.params().size(); ++i) {
        const ParamInfo& p = store_.params()[i];
        bf16_slots_.push_back(
            skip[i] ? MemoryPlan::Slot(-1)
                    : plan.add(MemClass::Parameters, p.name + ".bf16", DType::BF16, p.shape));
    }
}

void CudaParams::plan_master_rows(MemoryPlan& plan, int64_t i, int64_t row0, int64_t rows,
                                  MemClass where) {
    const ParamInfo& p = store_.params()[size_t(i)];
    ST_ASSERT(p.param_slot < 0 && !p.shape.empty() && 0 <= row0 && row0 + rows <= p.shape[0],
              "CudaParams: rows [", row0, ", ", row0 + rows, ") of '", p.name, "'");
    std::vector<int64_t> shape = p.shape;
    shape[0] = rows;
    const int64_t row = p.numel() / p.shape[0];
    row_masters_[i] = {
        plan.add(where, cat(p.name, " rows ", row0, "..", row0 + rows), DType::F32, shape),
        row0 * row};
}

void CudaParams::bind(const MemoryPlan& plan) {
    ST_ASSERT(bf16_slots_.size() == store_.params().size(), "CudaParams: bind before plan_bf16");
    all_.clear();
    for (size_t i = 0; i < store_.params().size(); ++i) {
        const ParamInfo& p = store_.params()[i];
        CudaParam g;
        g.master = p.param_slot < 0 ? nullptr : plan.view(p.param_slot).ptr<float>();
        if (p.grad_slot >= 0 && p.grad_bf16)
            g.grad16 = plan.view(p.grad_slot).ptr<bf16>();
        else if (p.grad_slot >= 0)
            g.grad = plan.view(p.grad_slot).ptr<float>();
        g.w = bf16_slots_[i] < 0 ? nullptr : plan.view(bf16_slots_[i]).ptr<bf16>();
        g.numel = p.numel();
        g.held = g.master ? g.numel : 0;
        if (const auto it = row_masters_.find(int64_t(i)); it != row_masters_.end()) {
            g.master = plan.view(it->second.first).ptr<float>();
            g.first = it->second.second;
            g.held = int64_t(plan.entries()[it->second.first].bytes / sizeof(float));
        }
        all_.push_back(g);
    }
    written_.assign(all_.size(), 0);
    written_before_.assign(all_.size(), 0);
    zeroed_.assign(all_.size(), 0);
}

bool bf16_gradient_allowed(const std::string& name) {
    static const char* const kGemmWritten[] = {
        "q_a_proj.weight",  "q_b_proj.weight",     "kv_a_proj_with_mqa.weight",
        "kv_b_proj.weight", "o_proj.weight",       "wq_b.weight",
        "wk.weight",        "weights_proj.weight", "gate_proj.weight",
        "up_proj.weight",   "down_proj.weight",    "eh_proj.weight",
        "lm_head.weight"};
    for (const char* end : kGemmWritten) {
        const size_t n = std::strlen(end);
        if (name.size() >= n && name.compare(name.size() - n, n, end) == 0) return true;
    }
    return false;
}

int64_t CudaParams::index(const std::string& name) const {
    const int64_t i = store_.index_of(name);
    ST_CHECK(i >= 0, "CUDA model: no parameter named '", name, "'");
    return i;
}

void CudaParams::refresh_bf16(const ExecContext& ctx) const {
    for (const auto& p : all_)
        if (p.w && p.master) cuda::f32_to_bf16(ctx, p.master, p.w + p.first, p.held);
}

}  // namespace sparsetron::cuda

namespace sparsetron::cuda {

void CudaParams::begin_gradients(const ExecContext& ctx, bool accumulate_only) const {
    written_before_ = written_;
    for (size_t i = 0; i < all_.size(); ++i) {
        written_[i] = zeroed_[i] = 0;
        if (accumulate_only && all_[i].has_grad()) {
            zero_grad(ctx, i);
            written_[i] = 1;
            continue;
        }
        // Not written last step (every gradient before the first step; a frozen part): zeroed
        // here, before any reduction of the step's gradients can read it.
        if (all_[i].has_grad() && !written_before_[i]) zero_grad(ctx, i);
    }
}

float CudaParams::grad_beta(int64_t i) const {
    ST_ASSERT(all_[size_t(i)].has_grad(), "grad_beta: '", store_.params()[size_t(i)].name,
              "' has no gradient");
    const bool first = !written_[size_t(i)];
    written_[size_t(i)] = 1;
    return first ? 0.f : 1.f;  // overwriting a zeroed gradient is the same as adding to it
}

float* CudaParams::grad_to_add(const ExecContext& ctx, int64_t i) const {
    ST_ASSERT(all_[size_t(i)].grad, "grad_to_add: '", store_.params()[size_t(i)].name,
              "' has no fp32 gradient (a bf16 gradient buffer is only written by GEMMs)");
    if (!written_[size_t(i)] && !zeroed_[size_t(i)]) zero_grad(ctx, size_t(i));
    written_[size_t(i)] = 1;
    return all_[size_t(i)].grad;
}

void CudaParams::finish_gradients(const ExecContext& ctx) const {
    for (size_t i = 0; i < all_.size(); ++i)
        if (all_[i].has_grad() && !written_[i] && !zeroed_[i]) zero_grad(ctx, i);
}

void CudaParams::zero_grad(const ExecContext& ctx, size_t i) const {
    cuda::zero(ctx, all_[i].grad_out(), all_[i].grad_bytes());
    zeroed_[i] = 1;
}

}  // namespace sparsetron::cuda
