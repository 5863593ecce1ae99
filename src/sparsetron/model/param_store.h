// ParamStore: the one table of parameters (DESIGN §3). Every parameter has its HuggingFace name,
// shape, optimizer group and init rule; checkpoints, optimizer routing and gradient reduction all
// iterate this table. Parameters and their gradients live in the plan's Parameters and Gradients
// arenas (one allocation each), in table order.
#pragma once

#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/core/memory_plan.h"

namespace sparsetron {

enum class OptimGroup : uint8_t { AdamW, Muon };
enum class InitRule : uint8_t { Normal, ScaledNormal, Ones, Zeros };

struct ParamInfo {
    std::string name;  // HF name, e.g. model.layers.3.self_attn.q_b_proj.weight
    std::vector<int64_t> shape;
    OptimGroup group = OptimGroup::AdamW;
    bool weight_decay = true;
    InitRule init = InitRule::Normal;
    MemoryPlan::Slot param_slot = -1;
    MemoryPlan::Slot grad_slot = -1;
    int64_t numel() const;
};

class ParamStore {
  public:
    // Declares every parameter of `m` that the engine implements today (embedding, per-layer MLA,
    // norms, dense SwiGLU, final norm, output head) into `plan` with element type `dtype`.
    ParamStore(const ModelConfig& m, MemoryPlan& plan, DType dtype);

    const std::vector<ParamInfo>& params() const { return params_; }
    const ParamInfo& at(const std::string& name) const;
    int64_t index_of(const std::string& name) const;  // -1 if absent
    int64_t total_numel() const;
    DType dtype() const { return dtype_; }

    // Fills every parameter from its init rule with a counter-based RNG keyed by (seed, name).
    void initialize(const MemoryPlan& plan, uint64_t seed, double std, int64_t num_layers) const;

  private:
    void add(std::string name, std::vector<int64_t> shape, InitRule init, OptimGroup group,
             bool decay);
    std::vector<ParamInfo> params_;
    MemoryPlan& plan_;
    DType dtype_;
};

}  // namespace sparsetron
