#include "sparsetron/ops/moe/grouped_gemm_plan.h"

namespace sparsetron::cuda {

const char* form_name(GroupedGemmForm form) {
    switch (form) {
        case GroupedGemmForm::Wgmma:
            return "Wgmma";
        case GroupedGemmForm::Wmma:
            return "Wmma";
        case GroupedGemmForm::Simple:
            return "Simple";
    }
    return "?";
}

namespace {
bool tensor_cores(const GroupedGemmShape& s) {
    const int64_t stride = s.weight_stride ? s.weight_stride : s.n * s.k;
    return s.n % 8 == 0 && s.k % 8 == 0 && stride % 8 == 0 && s.aligned;
}
}  // namespace

GroupedGemmForm plan_grouped_gemm(const GroupedGemmShape& s) {
    if (!tensor_cores(s)) return GroupedGemmForm::Simple;
    return s.sm90a ? GroupedGemmForm::Wgmma : GroupedGemmForm::Wmma;
}

std::vector<GroupedGemmForm> supported_grouped_gemm_forms(const GroupedGemmShape& s) {
    std::vector<GroupedGemmForm> out;
    if (tensor_cores(s) && s.sm90a) out.push_back(GroupedGemmForm::Wgmma);
    if (tensor_cores(s)) out.push_back(GroupedGemmForm::Wmma);
    out.push_back(GroupedGemmForm::Simple);
    return out;
}

}  // namespace sparsetron::cuda
