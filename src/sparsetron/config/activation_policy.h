// Which activations a layer keeps for its backward, from Megatron's selective recompute and
// fine-grained activation offload keys (recompute_granularity, recompute_modules,
// fine_grained_activation_offloading, offload_modules), parsed once into types: the modules as
// enums, the pairing of an offloaded output with the recompute module that would recompute it,
// and how each saved output lives (kept, recomputed, offloaded). The recipe keeps the names; the
// engine reads this.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace sparsetron {

// recompute_modules: the attention core's outputs (o', o), the query (and expanded keys /
// values) up-projections and Q', the layer's two RMSNorm outputs, the routed experts' SwiGLU
// output, the dense MLP's and the shared expert's gate and up outputs and SwiGLU.
enum class RecomputeModule : uint8_t { CoreAttn, MlaUpProj, Layernorm, MoeAct, Mlp, SharedExperts };
// offload_modules: the RMSNorm outputs, the query up-projection and Q', o' and the kept
// probabilities, o (the output projection's input), the routed experts' input rows and gate /
// up outputs, their SwiGLU output, their output rows (only through fused_group_mlp, which names
// the routed experts' three).
enum class OffloadModule : uint8_t {
    AttnNorm,
    MlpNorm,
    QkvLinear,
    CoreAttn,
    AttnProj,
    ExpertFc1,
    MoeAct,
    ExpertOut,
};

// The recipe's names, in the enums' order: every recompute module, and every offload module name
// a recipe may give (fused_group_mlp last; ExpertOut has no name of its own).
const std::vector<std::string>& recompute_module_names();
const std::vector<std::string>& offload_module_names();
const char* module_name(RecomputeModule m);
const char* module_name(OffloadModule m);

class ActivationPolicy {
  public:
    // From the recipe's keys. Throws, naming the key and the accepted names, for an unknown
    // module, and for an output both recomputed and offloaded.
    static ActivationPolicy parse(const std::string& recompute_granularity,
                                  const std::vector<std::string>& recompute_modules,
                                  bool fine_grained_activation_offloading,
                                  const std::vector<std::string>& offload_modules);
    static ActivationPolicy recompute_everything();

    bool recomputes(RecomputeModule m) const { return recompute_ >> unsigned(m) & 1u; }
    bool offloads(OffloadModule m) const { return offload_ >> unsigned(m) & 1u; }
    bool recomputes_everything() const;
    bool offloads_any() const { return offload_ != 0; }

    // How one saved output lives until its backward: recomputed where `recompute` names it,
    // else offloaded where `offload` does, else kept.
    enum class Saving : uint8_t { Kept, Recomputed, Offloaded };
    Saving saves(std::optional<RecomputeModule> recompute,
                 std::optional<OffloadModule> offload) const;

  private:
    uint32_t recompute_ = 0, offload_ = 0;
};

// The recompute module whose recomputation covers an offloaded output (none for the routed
// experts' input rows and outputs): both at once is refused.
std::optional<RecomputeModule> recompute_twin(OffloadModule m);

}  // namespace sparsetron
