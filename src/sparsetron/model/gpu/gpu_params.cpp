#include "sparsetron/model/gpu/gpu_common.h"

namespace sparsetron::gpu {

GpuParams::GpuParams(const ParamStore& store, MemoryPlan& plan) : store_(store) {
    ST_CHECK(store.dtype() == DType::F32, "the CUDA model keeps fp32 masters");
    for (const auto& p : store.params())
        bf16_slots_.push_back(
            plan.add(MemClass::Parameters, p.name + ".bf16", DType::BF16, p.shape));
}

void GpuParams::bind(const MemoryPlan& plan) {
    all_.clear();
    for (size_t i = 0; i < store_.params().size(); ++i) {
        const ParamInfo& p = store_.params()[i];
        GpuParam g;
        g.master = plan.view(p.param_slot).ptr<float>();
        g.grad = p.grad_slot < 0 ? nullptr : plan.view(p.grad_slot).ptr<float>();
        g.w = plan.view(bf16_slots_[i]).ptr<bf16>();
        g.numel = p.numel();
        all_.push_back(g);
    }
}

int64_t GpuParams::index(const std::string& name) const {
    const int64_t i = store_.index_of(name);
    ST_CHECK(i >= 0, "CUDA model: no parameter named '", name, "'");
    return i;
}

void GpuParams::refresh_bf16(const ExecContext& ctx) const {
    for (const auto& p : all_) cuda::f32_to_bf16(ctx, p.master, p.w, p.numel);
}

}  // namespace sparsetron::gpu
