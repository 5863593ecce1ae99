#include "sparsetron/runtime/cpu/grad_ranges.h"

#include <algorithm>

#include "sparsetron/core/error.h"

namespace sparsetron {

std::vector<GradRange> gradient_ranges(const ParamStore& store, const MemoryPlan& plan) {
    ST_CHECK(store.dtype() == DType::F32, "gradient ranges: fp32 gradients expected");
    struct Grad {
        float* p;
        int64_t n;
        bool expert;
    };
    std::vector<Grad> all;
    for (const ParamInfo& p : store.params())
        if (p.grad_slot >= 0)
            all.push_back({plan.view(p.grad_slot).ptr<float>(), p.numel(), p.routed_expert});
    std::sort(all.begin(), all.end(), [](const Grad& a, const Grad& b) { return a.p < b.p; });
    std::vector<GradRange> out;
    for (const Grad& g : all) {
        if (!out.empty() && out.back().routed_expert == g.expert) {
            out.back().count = int64_t(g.p + g.n - out.back().begin);
        } else {
            out.push_back({g.p, g.n, g.expert});
        }
    }
    return out;
}

}  // namespace sparsetron
