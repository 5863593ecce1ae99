// ParamStore: the one table of parameters (DESIGN §3). Every parameter has its HuggingFace name,
// shape, optimizer group and init rule; checkpoints, optimizer routing and gradient reduction all
// iterate this table. make_param_table (param_table.h) builds it from the model config; modules
// look their parameters up by name. Values and gradients live in the plan's Parameters and
// Gradients arenas, in registration order.
// Buffers (like the MoE expert bias) are saved with the weights but are not trained.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "sparsetron/core/memory_plan.h"

namespace sparsetron {

enum class OptimGroup : uint8_t { AdamW, Muon, None };
enum class InitRule : uint8_t { Normal, ScaledNormal, Ones, Zeros };

struct ParamInfo {
    std::string name;  // HF name, e.g. model.layers.3.self_attn.q_b_proj.weight
    std::vector<int64_t> shape;
    OptimGroup group = OptimGroup::AdamW;
    bool weight_decay = true;
    bool trainable = true;  // false for buffers
    bool mtp = false;       // belongs to the MTP layer (its own clipping group when detached)
    // A routed expert's weight: sharded over the expert-parallel group (each rank holds its own
    // experts), its gradient summed over the expert-data-parallel group only.
    bool routed_expert = false;
    // Pipeline parallelism: a copy of a parameter another stage also holds (the last stage's
    // embedding, which the MTP layer reads). Its gradient is summed with the original's and both
    // take the same update; it counts once in the gradient norm and is saved once.
    bool pipeline_copy = false;
    InitRule init = InitRule::Normal;
    // Its gradient planned in bf16 instead of the store's type (the CUDA model's bf16 gradient
    // buffers, grad_reduce_in_bf16).
    bool grad_bf16 = false;
    MemoryPlan::Slot param_slot = -1;
    MemoryPlan::Slot grad_slot = -1;  // -1 for buffers
    int64_t numel() const;
};

class ParamStore {
  public:
    // `plan_values`: each parameter's value slot planned as it is added; without it the owner
    // plans them later (plan_value), only for the parameters it keeps (the CUDA model under the
    // distributed optimizer, whose fp32 masters of other ranks' parameters are not held).
    ParamStore(MemoryPlan& plan, DType dtype, bool plan_values = true)
        : plan_(plan), dtype_(dtype), plan_values_(plan_values) {}

    // A trainable parameter; the group follows SPEC §7 (Muon for 2-D weights, AdamW otherwise)
    // unless `group` is given. Returns its index.
    int64_t add(std::string name, std::vector<int64_t> shape, InitRule init, bool decay = true);
    int64_t add_embedding_like(std::string name, std::vector<int64_t> shape);  // AdamW, 2-D
    int64_t add_buffer(std::string name, std::vector<int64_t> shape, InitRule init);
    void set_mtp_from(int64_t first_index);            // marks parameters [first_index, end) as MTP
    void set_routed_expert_from(int64_t first_index);  // ... as routed experts' weights
    void mark_pipeline_copy(int64_t index);
    int64_t size() const { return int64_t(params_.size()); }
    // A copy of another store's entry (same name, shape, group, flags) planned in this store's
    // plan: how a second backend's model gets the identical parameter table; its gradient in
    // bf16 when `grad_bf16`.
    int64_t add_like(const ParamInfo& other, bool grad_bf16 = false);
    // The value slot of parameter i, planned now (a store made without `plan_values`), in class
    // `where` (HostOffload: pinned host memory the device reads and writes).
    void plan_value(int64_t i, MemClass where = MemClass::Parameters);

    const std::vector<ParamInfo>& params() const { return params_; }
    const ParamInfo& at(const std::string& name) const;
    int64_t index_of(const std::string& name) const;  // -1 if absent
    int64_t index(const std::string& name) const;     // throws if absent
    int64_t total_numel(bool trainable_only = true) const;
    DType dtype() const { return dtype_; }

    // Fills every parameter from its init rule with a counter-based RNG keyed by (seed, name).
    void initialize(const MemoryPlan& plan, uint64_t seed, double std, int64_t num_layers) const;

  private:
    int64_t push(ParamInfo p);
    std::vector<ParamInfo> params_;
    std::unordered_map<std::string, int64_t> index_;  // name -> position in params_
    MemoryPlan& plan_;
    DType dtype_;
    bool plan_values_ = true;
};

}  // namespace sparsetron
