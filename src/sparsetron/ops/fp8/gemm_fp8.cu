// FP8 block-scaled GEMMs through cuBLASLt (Hopper, CUDA >= 12.9): e4m3 operands with one fp32
// scale per 1x128 or 128x128 block, bf16 output. Hopper's FP8 tensor cores take only the "TN"
// form (both operands with the contraction contiguous), so row-major y = x w^T is column-major
// y^T = w x^T with w in cuBLASLt's A slot (transposed) and x in its B slot.
#include "sparsetron/cuda/libraries.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace sparsetron::cuda {
namespace {

cublasLtMatmulMatrixScale_t scale_mode(const Fp8Operand& o) {
    return o.blocks_128x128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                            : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
}

// The operands' scale pointers into the descriptor (cuBLASLt reads them at enqueue time).
void point_scales(cublasLtMatmulDesc_t op, const Fp8Operand& x, const Fp8Operand& w) {
    const void* sa = w.scale_inv;
    const void* sb = x.scale_inv;
    ST_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    ST_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
}

GemmPlan make_fp8_plan(Libraries& libs, int64_t m, int64_t n, int64_t k, int64_t ldy,
                       const Fp8Operand& x, const Fp8Operand& w, bool out_f32) {
    GemmPlan p;
    ST_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = CUBLAS_OP_T, op_b = CUBLAS_OP_N;
    ST_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    ST_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    // Block scaling needs the exact accumulation (the scales are applied per 128-wide block).
    const int8_t fast_accum = 0;
    ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                   &fast_accum, sizeof(fast_accum)));
    const cublasLtMatmulMatrixScale_t mode_a = scale_mode(w), mode_b = scale_mode(x);
    ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a,
                                                   sizeof(mode_a)));
    ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b,
                                                   sizeof(mode_b)));
    // The scale pointers are set per call (the attribute is part of the descriptor, so a plan is
    // cached per shape and re-pointed: cublasLtMatmul reads them at enqueue time).
    ST_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, k, n, k));
    ST_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, k, m, k));
    ST_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&p.c, out_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, ldy));
    cublasLtMatmulPreference_t pref = nullptr;
    ST_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    ST_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &libs.workspace_bytes, sizeof(libs.workspace_bytes)));
    // The heuristic needs the scale pointers' modes only; any non-null pointers do here.
    point_scales(p.op, x, w);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(libs.lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    // A shape the block-scaled kernels do not take (rows not in whole tiles of the scale
    // layout, e.g. m = 33) is refused here, not at the multiply.
    ST_CHECK(st != CUBLAS_STATUS_NOT_SUPPORTED,
             "cuBLASLt's block-scaled FP8 GEMM does not take m=", m, " n=", n, " k=", k,
             " (its heuristic says not supported)");
    ST_CUBLAS_CHECK(st);
    ST_CHECK(found > 0, "cuBLASLt has no block-scaled FP8 algorithm for m=", m, " n=", n, " k=", k,
             " (needs Hopper and cuBLAS >= 12.9)");
    p.algo = result.algo;
    return p;
}

void gemm_fp8(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, const Fp8Operand& x,
              const Fp8Operand& w, void* y, bool out_f32, int64_t ldy, bool accumulate) {
    ST_ASSERT(ctx.libs, "cuda::gemm_fp8_blockwise needs an ExecContext from a CudaSession");
    if (m == 0 || n == 0) return;
    ST_CHECK(!(x.blocks_128x128 && w.blocks_128x128),
             "FP8 GEMM: cuBLASLt does not take 128x128 scales on both operands");
    ST_CHECK(k % 16 == 0 && ldy % 8 == 0, "FP8 GEMM: k (", k,
             ") must be a multiple of 16 and ldy (", ldy, ") of 8");
    Libraries& libs = *ctx.libs;
    const std::array<int64_t, 7> key{m, n, k, ldy, x.blocks_128x128, w.blocks_128x128, out_f32};
    auto it = libs.fp8_plans.find(key);
    if (it == libs.fp8_plans.end())
        it = libs.fp8_plans.emplace(key, make_fp8_plan(libs, m, n, k, ldy, x, w, out_f32)).first;
    const GemmPlan& p = it->second;
    point_scales(p.op, x, w);
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    ST_CUBLAS_CHECK(cublasLtMatmul(libs.lt, p.op, &alpha, w.q, p.a, x.q, p.b, &beta, y, p.c, y, p.c,
                                   &p.algo, libs.workspace, libs.workspace_bytes,
                                   static_cast<cudaStream_t>(ctx.stream)));
}

}  // namespace

void gemm_fp8_blockwise(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, Fp8Operand x,
                        Fp8Operand w, bf16* y, int64_t ldy, bool accumulate) {
    gemm_fp8(ctx, m, n, k, x, w, y, false, ldy, accumulate);
}

void gemm_fp8_blockwise(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, Fp8Operand x,
                        Fp8Operand w, float* y, int64_t ldy, bool accumulate) {
    gemm_fp8(ctx, m, n, k, x, w, y, true, ldy, accumulate);
}

}  // namespace sparsetron::cuda
