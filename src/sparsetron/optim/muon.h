// Muon (SPEC §7): momentum, Newton-Schulz orthogonalization, decoupled weight decay and the
// scale modes, with per-head splits of the MLA up-projections. Written over the engine's GEMM
// so the CUDA backend can reuse the same structure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/run_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/optim/newton_schulz.h"

namespace sparsetron {

// A parameter's Newton-Schulz slices: row groups orthogonalized independently. Each slice is a
// list of row ranges gathered into one matrix (a per-projection split gathers rows of all heads).
struct MuonSlice {
    std::vector<std::pair<int64_t, int64_t>> rows;  // [begin, end) row ranges
    int64_t num_rows() const;
};
struct MuonSplit {
    std::string kind = "none";  // "none" | "per_head" | "per_projection"
    std::vector<MuonSlice> slices;
};

// Muon updates the trainable parameters of its group (with `optimizer: muon`; the rest go to
// AdamW).
inline bool is_muon_param(const ParamInfo& p) {
    return p.trainable && p.group == OptimGroup::Muon;
}

// The split of `p` under the recipe's Muon settings (q_b_proj and kv_b_proj only; SPEC §7).
MuonSplit muon_split_for(const ParamInfo& p, const ModelConfig& m, const RunConfig& r);

double muon_scale(int64_t m, int64_t n, const std::string& mode);

// The Newton-Schulz polynomial (a, b, c) of iteration `step`: X <- a X + (b A + c A^2) X, A = X
// X^T.
struct MuonCoefficients {
    double a, b, c;
};
MuonCoefficients muon_ns_coefficients(const std::string& type, int64_t step);

// FLOPs (2 per multiply-add) of one step's Newton-Schulz over Muon matrices: outside SPEC §8's
// count, the optimizer's largest cost. Symmetric products at 3/4 as the CUDA batches run them
// (newton_schulz_cost); `chosen` in the form muon_ns_method picks per matrix.
struct NewtonSchulzCount {
    double standard_flops = 0, chosen_flops = 0;
    int64_t matrices = 0, gram_matrices = 0;
};
// Every slice of every split (an empty split: not a Muon parameter) of parameters [rows_i, cols_i].
NewtonSchulzCount newton_schulz_count(const std::vector<MuonSplit>& splits,
                                      const std::vector<std::vector<int64_t>>& shapes,
                                      const RunConfig& r);

// The same for a model's parameters under the recipe (zeros unless `optimizer: muon`): its
// trainable Muon-group parameters with their splits, as Muon itself takes them.
NewtonSchulzCount newton_schulz_count(const ParamStore& store, const ModelConfig& m,
                                      const RunConfig& r);

class Muon {
  public:
    Muon(const ParamStore& store, MemoryPlan& plan, const ModelConfig& m, const RunConfig& r);
    // One update of every Muon-group parameter (grads already clipped by `grad_scale`).
    void step(const MemoryPlan& plan, const RunConfig& run, double lr, double grad_scale,
              const std::vector<bool>* update = nullptr);
    const std::vector<MemoryPlan::Slot>& momentum_slots() const { return momentum_; }
    const MuonSplit& split(int64_t param) const { return splits_[param]; }

  private:
    const ParamStore& store_;
    std::vector<MemoryPlan::Slot> momentum_;  // -1 for non-Muon parameters
    std::vector<MuonSplit> splits_;
};

}  // namespace sparsetron
