// Dense GEMMs through cuBLASLt. Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T,
// so B goes in cuBLASLt's A slot and A in its B slot with the same transposes.
#include "sparsetron/cuda/libraries.h"
#include "sparsetron/ops/gemm/gemm.h"

namespace sparsetron::cuda {
namespace {

cudaDataType_t lt_type(DType t) {
    switch (t) {
        case DType::BF16:
            return CUDA_R_16BF;
        case DType::F32:
            return CUDA_R_32F;
        case DType::F16:
            return CUDA_R_16F;
        default:
            throw Error(cat("cuda::gemm: unsupported element type ", dtype_name(t)));
    }
}

cublasLtMatrixLayout_t layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                              const GemmBatch& b, int64_t stride) {
    cublasLtMatrixLayout_t l = nullptr;
    ST_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld));
    if (b.count > 1) {
        int32_t count = static_cast<int32_t>(b.count);
        ST_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                         &count, sizeof(count)));
        ST_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
            l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
    return l;
}

GemmPlan make_plan(Libraries& libs, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda,
                   int64_t ldb, int64_t ldc, DType ab, DType ct, const GemmBatch& batch) {
    GemmPlan p;
    const cublasComputeType_t compute =
        batch.tf32 && ab == DType::F32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    ST_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, compute, CUDA_R_32F));
    // cuBLASLt's A is our B (column-major B^T), its B is our A.
    cublasOperation_t op_lt_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_lt_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a,
                                                   sizeof(op_lt_a)));
    ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b,
                                                   sizeof(op_lt_b)));
    // Column-major shapes as stored: our B is [k, n] (or [n, k] if tb) row-major.
    p.a = tb ? layout(lt_type(ab), k, n, ldb, batch, batch.stride_b)
             : layout(lt_type(ab), n, k, ldb, batch, batch.stride_b);
    p.b = ta ? layout(lt_type(ab), m, k, lda, batch, batch.stride_a)
             : layout(lt_type(ab), k, m, lda, batch, batch.stride_a);
    p.c = layout(lt_type(ct), n, m, ldc, batch, batch.stride_c);
    cublasLtMatmulPreference_t pref = nullptr;
    ST_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    ST_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &libs.workspace_bytes, sizeof(libs.workspace_bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    ST_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(libs.lt, p.op, p.a, p.b, p.c, p.c, pref, 1,
                                                   &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    ST_CHECK(found > 0, "cuBLASLt has no algorithm for GEMM m=", m, " n=", n, " k=", k, " (",
             dtype_name(ab), " -> ", dtype_name(ct), ")");
    p.algo = result.algo;
    return p;
}

}  // namespace

void gemm(const ExecContext& ctx, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c, int64_t ldc,
          DType ab, DType ct, GemmBatch batch) {
    gemm_out(ctx, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, c, ldc, ab, ct, batch);
}

void gemm_out(const ExecContext& ctx, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
              float alpha, const void* a, int64_t lda, const void* b, int64_t ldb, float beta,
              const void* c_in, void* d, int64_t ldc, DType ab, DType ct, GemmBatch batch) {
    ST_ASSERT(ctx.libs, "cuda::gemm needs an ExecContext from a CudaSession");
    if (m == 0 || n == 0) return;
    Libraries& libs = *ctx.libs;
    const std::array<int64_t, 15> key{ta,
                                      tb,
                                      m,
                                      n,
                                      k,
                                      lda,
                                      ldb,
                                      ldc,
                                      int64_t(ab),
                                      int64_t(ct),
                                      batch.count,
                                      batch.stride_a,
                                      batch.stride_b,
                                      batch.stride_c,
                                      batch.tf32};
    auto it = libs.plans.find(key);
    if (it == libs.plans.end())
        it = libs.plans.emplace(key, make_plan(libs, ta, tb, m, n, k, lda, ldb, ldc, ab, ct, batch))
                 .first;
    const GemmPlan& p = it->second;
    ST_CUBLAS_CHECK(cublasLtMatmul(libs.lt, p.op, &alpha, b, p.a, a, p.b, &beta, c_in, p.c, d, p.c,
                                   &p.algo, libs.workspace, libs.workspace_bytes,
                                   static_cast<cudaStream_t>(ctx.stream)));
}

}  // namespace sparsetron::cuda
