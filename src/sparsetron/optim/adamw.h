// AdamW over the ParamStore with fp32 state (SPEC §7; Muon arrives with its own issue), plus
// global-norm gradient clipping. Non-finite gradients skip the update and are reported.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/config/run_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/param_store.h"

namespace sparsetron {

struct StepStats {
    double grad_norm = 0;  // before clipping
    double clip_scale = 1;
    double lr = 0;
    bool skipped = false;  // non-finite gradient: weights untouched
};

class AdamW {
  public:
    // Declares exp_avg / exp_avg_sq for every parameter in the plan's OptimizerState class.
    AdamW(const ParamStore& store, MemoryPlan& plan);

    // Clips by global norm, then updates every parameter (or those `update[i]` marks); `step` is
    // 1-based.
    StepStats step(const MemoryPlan& plan, const RunConfig& run, int64_t step,
                   const std::vector<bool>* update = nullptr) const;

    const std::vector<MemoryPlan::Slot>& exp_avg_slots() const { return m_; }
    const std::vector<MemoryPlan::Slot>& exp_avg_sq_slots() const { return v_; }

  private:
    const ParamStore& store_;
    std::vector<MemoryPlan::Slot> m_, v_;
};

// Global L2 norm of all gradients (fixed summation order).
double global_grad_norm(const ParamStore& store, const MemoryPlan& plan,
                        const std::vector<bool>* only = nullptr);
void zero_grads(const MemoryPlan& plan);

}  // namespace sparsetron
