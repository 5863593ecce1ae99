// Mixture of experts: the sigmoid router with its top-k, the expert-major permutation, the
// gather / combine of rows and their backwards, the grouped expert GEMM over device-side counts,
// the routing statistics and the aux-loss-free bias update. CPU reference: moe_cpu.cpp; CUDA:
// moe.cu, grouped GEMM forms in grouped_gemm_forms.h. Tests: tests/ops/test_moe.cpp,
// tests/gpu/ops/test_moe_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/moe/grouped_gemm_plan.h"

namespace sparsetron::cpu {

// The router (SPEC §4): probs = sigmoid(logits) for every row of [tokens, experts] (probs may be
// logits); for the first `routed` rows (the micro-batch's real rows), the top-k experts of probs
// + bias, ties toward the smaller expert (force_balance: row t takes experts (t k + j) mod E
// instead), and gates = scaling * p / (1e-20 + Σ p over the chosen).
template <typename T>
void router_topk(const T* logits, const T* bias, int64_t tokens, int64_t routed, int64_t experts,
                 int64_t k, bool force_balance, double scaling, T* probs, int32_t* topk, T* gates);

// The expert-major permutation of the first `routed` rows' choices, token order within an
// expert, at most `capacity` rows per expert: counts[E] (routed, before capacity), offsets[E + 1]
// (kept rows), slot_row [tokens * k] (-1 if dropped or not routed), perm_token [offsets[E]].
void moe_permute(const int32_t* topk, int64_t routed, int64_t tokens, int64_t experts, int64_t k,
                 int64_t capacity, int64_t* counts, int64_t* offsets, int32_t* slot_row,
                 int32_t* perm_token);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// probs = sigmoid(logits) [T, E]; top-k of probs + bias (ties toward the smaller expert, or the
// forced round-robin choice); gates = scaling * p / Σ p over the chosen. Padding rows get -1.
void router_topk(const ExecContext& ctx, const float* logits, const float* bias,
                 const int32_t* row_begin, int64_t tokens, int64_t experts, int64_t k,
                 bool force_balance, float scaling, float* probs, int32_t* topk, float* gates);
// Expert-major permutation, token order within an expert, at most `capacity` rows per expert:
// counts[E] (routed, before capacity), offsets[E+1] (kept rows), slot_row [T*k] (-1 if dropped
// or padding), perm_token [T*k] (rows >= offsets[E] are left as they were).
void moe_permute(const ExecContext& ctx, const int32_t* topk, int64_t tokens, int64_t experts,
                 int64_t k, int64_t capacity, int32_t* counts, int32_t* offsets, int32_t* slot_row,
                 int32_t* perm_token);
// out[r] = x[perm_token[r]] for r < offsets[E].
// out8: the FP8 copy of the gathered rows (ops/fp8/fp8.h, Fp8RowsOut; rows past offsets[E]
// unwritten).
void moe_gather(const ExecContext& ctx, const bf16* x, const int32_t* perm_token,
                const int32_t* offsets, int64_t experts, int64_t rows, int64_t dim, bf16* out,
                const Fp8RowsOut& out8 = {});
// y[t] += Σ_j gates[t, j] * out_perm[slot_row[t, j]].
void moe_combine(const ExecContext& ctx, const bf16* out_perm, const int32_t* slot_row,
                 const float* gates, int64_t tokens, int64_t k, int64_t dim, bf16* y);

// Grouped GEMM over the permuted layout, expert e owning rows [offsets[e], offsets[e+1]):
//   RowsTimesWeightT: C[r, :] = A[r, :] @ W_e^T      A [R, K], W [E, N, K], C [R, N] bf16
//   RowsTimesWeight:  C[r, :] = A[r, :] @ W_e        A [R, N], W [E, N, K], C [R, K] bf16
//   WeightGrad:       dW_e (+)= A_e^T @ B_e          A [R, N], B [R, K], dW [E, N, K] fp32/bf16
// max_rows bounds any expert's row count (the capacity); counts are read from device memory.
// row_capacity: the rows the row operands' buffers hold (A, and B for WeightGrad; offsets[E] <=
// row_capacity): the bound of the kernels' bulk tensor loads, which read whole tiles past an
// expert's last row (never past the buffer).
enum class GroupedGemm { RowsTimesWeightT, RowsTimesWeight, WeightGrad };
// `weight_stride`: elements between consecutive experts' weights (0 = n * k, packed). With
// `accumulate` the outputs are added to; without, they are written, and WeightGrad writes every
// expert's dW (zeros for an expert with no rows), so a step's first weight gradient needs no
// memset of the gradient before it and its tiles are not read.
struct GroupedGemmArgs {
    GroupedGemm kind = GroupedGemm::RowsTimesWeightT;
    const int32_t* offsets = nullptr;  // [experts + 1], device
    int64_t experts = 0, max_rows = 0, row_capacity = 0, n = 0, k = 0;
    const bf16* a = nullptr;
    const bf16* b = nullptr;
    void* c = nullptr;
    int64_t weight_stride = 0;
    bool accumulate = false;
    // WeightGrad's dW: F32, or BF16 (bf16 gradient buffers: the fp32 sum rounded once, or
    // rounded and added to the bf16 gradient with `accumulate`).
    DType grad_type = DType::F32;
};
// In the form plan_grouped_gemm (grouped_gemm_plan.h) gives the call's shape, or in a given one
// (one of supported_grouped_gemm_forms for the shape: the tests walk them).
void grouped_gemm(const ExecContext& ctx, const GroupedGemmArgs& g);
void grouped_gemm(const ExecContext& ctx, GroupedGemmForm form, const GroupedGemmArgs& g);
// The shape a call is planned from: its dimensions, its operands' alignment and the device.
GroupedGemmShape grouped_gemm_shape(const GroupedGemmArgs& g);

// The routed experts' FP8 GEMM (grouped_gemm_fp8.cu, sm_90a wgmma; operands and scales as fp8.h):
// grouped_gemm's RowsTimesWeightT for e4m3 operands. For every expert e with rows [offsets[e],
// offsets[e+1]): y[rows] (+)= x[rows] W_e^T; x [row_capacity, k] with 1x128 scales (the GEMM layout
// of row_capacity rows), W [experts][n][k] packed with 128x128 scales per expert
// (fp8::scales_128x128(n, k) floats apart). Products in fp32, scaled per 128-deep block of k, y
// rounded to bf16. k a multiple of 16, n of 8. The input gradient is the same call on the W^T
// copies. `blocks` > 0 caps the persistent grid (tests: every block walks many tiles).
struct Fp8GroupedGemm {
    const int32_t* offsets = nullptr;  // [experts + 1], device
    int64_t experts = 0, max_rows = 0, row_capacity = 0, n = 0, k = 0;
    Fp8Operand x, w;
    bf16* y = nullptr;
    bool accumulate = false;
};
void grouped_gemm_fp8(const ExecContext& ctx, const Fp8GroupedGemm& g, int blocks = 0);
// Whether this GPU runs it (sm_90a); grouped_gemm_fp8 fails clearly where not.
bool grouped_gemm_fp8_available();

// The routed experts' weight gradients in FP8 (grouped_gemm_fp8_wgrad.cu, sm_90a): for every
// expert e with rows, dW_e [n, k] (+)= dy_e^T x_e over its rows, from dy^T [n, padded] and x^T
// [k, padded] as quantize_fp8_1x128_expert_columns writes them (each expert's rows in its own
// 128-aligned segment, 1x128 scales along the tokens). dW [experts][n][k], `weight_stride`
// elements apart (0: n * k), fp32 or bf16 (grad_type); written (experts with no rows get zeros)
// or added to. n and k multiples of 8. `blocks` > 0 caps the persistent grid (tests).
struct Fp8GroupedWeightGrad {
    const int32_t* offsets = nullptr;  // [experts + 1], device
    int64_t experts = 0, n = 0, k = 0, padded = 0;
    Fp8Operand dyt, xt;
    void* dw = nullptr;
    DType grad_type = DType::F32;
    int64_t weight_stride = 0;
    bool accumulate = false;
};
void grouped_gemm_fp8_weight_grad(const ExecContext& ctx, const Fp8GroupedWeightGrad& g,
                                  int blocks = 0);

// Backward of moe_combine: dout_perm[slot] = gate * dy[t] (rows without a slot untouched) and
// dgates[t, j] = dy[t] · out_perm[slot] (0 when not routed).
// dout8: the FP8 copy of dout_perm's written rows (ops/fp8/fp8.h, Fp8RowsOut).
void moe_combine_backward(const ExecContext& ctx, const bf16* dy, const bf16* out_perm,
                          const int32_t* slot_row, const float* gates, int64_t tokens, int64_t k,
                          int64_t dim, bf16* dout_perm, float* dgates,
                          const Fp8RowsOut& dout8 = {});
// The combine's backward without the experts' output rows, for rows whose output gradients went
// through the down projection unscaled (dout_perm[r] = dy[t], du = dout_perm @ W_down): since
// out = act @ W_downᵀ, dgates[t, j] = dy[t] · out[r] = du[r] · act[r] (r = slot_row[t, j]; 0 when
// not routed); then du[r] and dout_perm[r] are scaled by the gate in place (the SwiGLU's input
// gradient and the down projection's weight-gradient operand). `inner`: du / act width,
// `dim`: dout_perm width.
void moe_gate_backward_rows(const ExecContext& ctx, bf16* du, const bf16* act,
                            const int32_t* slot_row, const float* gates, int64_t tokens, int64_t k,
                            int64_t inner, int64_t dim, bf16* dout_perm, float* dgates);
// Backward of moe_gather: dx[t] (+)= Σ_j dx_perm[slot_row[t, j]] in j order (deterministic).
void moe_gather_backward(const ExecContext& ctx, const bf16* dx_perm, const int32_t* slot_row,
                         int64_t tokens, int64_t k, int64_t dim, bf16* dx, bool accumulate);
// dlogits [T, E] (fp32) from the gate gradients: gates = scaling * s_c / Σ s_chosen, s =
// sigmoid(logits). Unrouted rows and unchosen experts get 0.
void router_backward(const ExecContext& ctx, const float* probs, const int32_t* topk,
                     const float* dgates, int64_t tokens, int64_t experts, int64_t k, float scaling,
                     float* dlogits);
// load[e] += counts[e]; dropped[0] += Σ max(0, counts[e] - capacity).
void moe_count_load(const ExecContext& ctx, const int32_t* counts, int64_t experts,
                    int64_t capacity, int64_t* load, int64_t* dropped);
// Aux-loss-free balancing: bias[e] += rate * sign(mean(load) - load[e]).
void moe_update_bias(const ExecContext& ctx, const int64_t* load, int64_t experts, float rate,
                     float* bias);

}  // namespace sparsetron::cuda
