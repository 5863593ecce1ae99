#include "sparsetron/config/activation_policy.h"

#include <algorithm>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

std::string joined(std::vector<std::string> names) {
    std::sort(names.begin(), names.end());
    std::string out;
    for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
}

}  // namespace

const std::vector<std::string>& recompute_module_names() {
    static const std::vector<std::string> names = {"core_attn", "mla_up_proj", "layernorm",
                                                   "moe_act",   "mlp",         "shared_experts"};
    return names;
}

const std::vector<std::string>& offload_module_names() {
    static const std::vector<std::string> names = {"attn_norm", "mlp_norm",       "qkv_linear",
                                                   "core_attn", "attn_proj",      "expert_fc1",
                                                   "moe_act",   "fused_group_mlp"};
    return names;
}

const char* module_name(RecomputeModule m) {
    return recompute_module_names()[size_t(m)].c_str();
}

const char* module_name(OffloadModule m) {
    return m == OffloadModule::ExpertOut ? "expert_out" : offload_module_names()[size_t(m)].c_str();
}

std::optional<RecomputeModule> recompute_twin(OffloadModule m) {
    switch (m) {
        case OffloadModule::AttnNorm:
        case OffloadModule::MlpNorm:
            return RecomputeModule::Layernorm;
        case OffloadModule::QkvLinear:
            return RecomputeModule::MlaUpProj;
        case OffloadModule::CoreAttn:
        case OffloadModule::AttnProj:
            return RecomputeModule::CoreAttn;
        case OffloadModule::MoeAct:
            return RecomputeModule::MoeAct;
        case OffloadModule::ExpertFc1:
        case OffloadModule::ExpertOut:
            return std::nullopt;
    }
    return std::nullopt;
}

ActivationPolicy ActivationPolicy::parse(const std::string& granularity,
                                         const std::vector<std::string>& recompute, bool offload,
                                         const std::vector<std::string>& offloaded) {
    ActivationPolicy p;
    const auto& rnames = recompute_module_names();
    for (const std::string& m : recompute) {
        const auto it = std::find(rnames.begin(), rnames.end(), m);
        ST_CHECK(it != rnames.end(), "recipe key 'recompute_modules' is \"", m,
                 "\"; expected one of: ", joined(rnames));
        if (granularity == "selective") p.recompute_ |= 1u << unsigned(it - rnames.begin());
    }
    if (!offload) return p;
    ST_CHECK(!offloaded.empty(),
             "fine_grained_activation_offloading: true needs offload_modules (from ",
             joined(offload_module_names()), ")");
    const auto& onames = offload_module_names();
    for (const std::string& m : offloaded) {
        const auto it = std::find(onames.begin(), onames.end(), m);
        ST_CHECK(it != onames.end(), "recipe key 'offload_modules' is \"", m,
                 "\"; expected one of: ", joined(onames));
        std::vector<OffloadModule> mods;
        if (m == "fused_group_mlp")
            mods = {OffloadModule::ExpertFc1, OffloadModule::MoeAct, OffloadModule::ExpertOut};
        else
            mods = {OffloadModule(it - onames.begin())};
        for (OffloadModule o : mods) {
            // A recomputed output has no per-layer copy to offload.
            const auto twin = recompute_twin(o);
            ST_CHECK(!twin || !p.recomputes(*twin), "offload_modules names ", m,
                     " and recompute_modules names ", module_name(*twin),
                     ": its activations are either recomputed or offloaded; drop one");
            p.offload_ |= 1u << unsigned(o);
        }
    }
    return p;
}

ActivationPolicy ActivationPolicy::recompute_everything() {
    ActivationPolicy p;
    p.recompute_ = (1u << recompute_module_names().size()) - 1;
    return p;
}

bool ActivationPolicy::recomputes_everything() const {
    return recompute_ == recompute_everything().recompute_;
}

ActivationPolicy::Saving ActivationPolicy::saves(std::optional<RecomputeModule> recompute,
                                                 std::optional<OffloadModule> offload) const {
    if (recompute && recomputes(*recompute)) return Saving::Recomputed;
    if (offload && offloads(*offload)) return Saving::Offloaded;
    return Saving::Kept;
}

}  // namespace sparsetron
