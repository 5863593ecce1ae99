// AdamW with fp32 state (SPEC §7) over the parameters it is given.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/config/run_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/param_store.h"

namespace sparsetron {

class AdamW {
  public:
    // Declares exp_avg / exp_avg_sq for each parameter with handles[i] (all trainable ones when
    // `handles` is empty) in the plan's OptimizerState class.
    AdamW(const ParamStore& store, MemoryPlan& plan, std::vector<bool> handles = {});

    // Updates the handled parameters (and those `update[i]` marks); grad_scale[i] multiplies the
    // gradient of parameter i (the clipping factor of its group). `step` is 1-based.
    void step(const MemoryPlan& plan, const RunConfig& run, int64_t step, double lr,
              const std::vector<double>& grad_scale, const std::vector<bool>* update) const;

    const std::vector<MemoryPlan::Slot>& exp_avg_slots() const { return m_; }
    const std::vector<MemoryPlan::Slot>& exp_avg_sq_slots() const { return v_; }

  private:
    const ParamStore& store_;
    std::vector<MemoryPlan::Slot> m_, v_;  // -1 where not handled
};

// Sums of squared gradients by bucket: sums[bucket[i]] += |grad_i|^2 for every trainable
// parameter i with bucket[i] >= 0, in parameter order (fixed).
void grad_sum_squares(const ParamStore& store, const MemoryPlan& plan,
                      const std::vector<int>& bucket, double* sums);
void zero_grads(const MemoryPlan& plan);

}  // namespace sparsetron
