// Which form of the grouped expert GEMM (moe.h's grouped_gemm) runs, decided in one function:
// the forms, the shape they are chosen from (dimensions, the operands' 16-byte alignment, the
// device) and the choice. grouped_gemm plans each call from its arguments (their pointers are part
// of the shape) and switches on the form; the tests walk supported_grouped_gemm_forms(). Host code
// only: it builds and is tested without CUDA.
#pragma once

#include <cstdint>
#include <vector>

namespace sparsetron::cuda {

enum class GroupedGemmForm : uint8_t {
    Wgmma,   // warp-specialized persistent wgmma (grouped_gemm_wgmma.cu): sm_90a, aligned
    Wmma,    // pipelined WMMA (grouped_gemm_wmma.cu): aligned
    Simple,  // one simple kernel (moe.cu): any shape
};
const char* form_name(GroupedGemmForm form);

struct GroupedGemmShape {
    int64_t n = 0, k = 0, weight_stride = 0;  // weight_stride 0: n x k
    bool aligned = false;                     // the operands' pointers 16-byte aligned
    bool sm90a = false;
};

// The tensor cores whenever rows are 16-byte aligned (dimensions and strides multiples of 8 bf16,
// pointers aligned): the wgmma kernel on sm_90a, the WMMA one elsewhere; the simple kernel for the
// rest (odd test shapes).
GroupedGemmForm plan_grouped_gemm(const GroupedGemmShape& s);
// The forms the shape can run (the simple kernel always), in the enum's order.
std::vector<GroupedGemmForm> supported_grouped_gemm_forms(const GroupedGemmShape& s);

}  // namespace sparsetron::cuda
