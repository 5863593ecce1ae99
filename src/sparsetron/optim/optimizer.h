// The optimizer of a run (SPEC §7): AdamW for every parameter, or Muon for the 2-D weights other
// than embedding and head with AdamW for the rest; global-norm clipping by group (the MTP layer is
// its own group when its heads are detached); non-finite gradients skip the step untouched.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sparsetron/optim/adamw.h"
#include "sparsetron/optim/muon.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

struct StepStats {
    double grad_norm = 0;      // backbone (or everything, with one clipping group), before clipping
    double grad_norm_mtp = 0;  // the MTP group's, when it is separate
    double lr = 0;
    bool skipped = false;  // a non-finite gradient: weights and state untouched
};

class Optimizer {
  public:
    Optimizer(const ParamStore& store, MemoryPlan& plan, const ModelConfig& m, const RunConfig& r);
    // `update` (optional) restricts which parameters move and enter the gradient norm (dense
    // warm-up: the indexer only). `owned` (optional) restricts the updates only, not the norm: a
    // distributed optimizer's rank updates its own parameters of a globally clipped step.
    StepStats step(const MemoryPlan& plan, const RunConfig& run, int64_t step,
                   const std::vector<bool>* update = nullptr,
                   const std::vector<bool>* owned = nullptr);

    // Expert parallelism with sharded experts: a rank holds only its experts' gradients, so
    // their squared norms are summed over `ep` (the expert-parallel group) into the global norm.
    void set_expert_parallel(Comm* ep) { ep_ = ep && ep->size() > 1 ? ep : nullptr; }
    // Pipeline parallelism: a stage holds its layers' gradients, so the squared norms are summed
    // over `pp` (one rank per stage); a pipeline copy counts on the stage of the original only.
    void set_pipeline_parallel(Comm* pp) { pp_ = pp && pp->size() > 1 ? pp : nullptr; }

    // Every state tensor by checkpoint name ("<param>.exp_avg", "<param>.momentum_buffer", ...).
    std::vector<std::pair<std::string, MemoryPlan::Slot>> state_tensors() const;
    // What `sparsetron plan` prints per parameter: optimizer, split, state bytes.
    std::string describe(const MemoryPlan& plan) const;

  private:
    const ParamStore& store_;
    std::unique_ptr<AdamW> adamw_;
    std::unique_ptr<Muon> muon_;
    std::vector<bool> uses_muon_, mtp_group_;
    bool separate_mtp_ = false;
    Comm* ep_ = nullptr;
    Comm* pp_ = nullptr;
};

}  // namespace sparsetron
