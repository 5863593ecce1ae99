// GEMM: C[m,n] = alpha * op(A) @ op(B) + beta * C, row-major with leading dimensions.
// CPU: OpenBLAS (gemm_cpu.cpp). CUDA: cuBLASLt with cached plans (gemm.cu). Tests:
// tests/ops/test_gemm.cpp (CPU), tests/gpu/ops/test_gemm_cuda.cpp (CUDA against the CPU).
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"

namespace sparsetron::cpu {

// C[m,n] = alpha * op(A) @ op(B) + beta * C, row-major with leading dimensions.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// C[m,n] = alpha * op(A) @ op(B) + beta * C, row-major with leading dimensions, like cpu::gemm.
// A and B have `ab` type (BF16 or F32), C has `c_type` (BF16 or F32); fp32 accumulation.
// `batch` > 1 runs independent problems at the given element strides.
struct GemmBatch {
    int64_t count = 1, stride_a = 0, stride_b = 0, stride_c = 0;
    // fp32 inputs: let cuBLASLt use TF32 tensor cores (Muon's Newton-Schulz at
    // muon_fp32_matmul_prec "medium"/"high"; never for the router or the tests' fp32 references).
    // CUBLAS_COMPUTE_32F_FAST_16BF was tried for "medium": on the H200 it gave TF32's error and
    // time exactly (docs/optimizer.md), so bf16 Newton-Schulz needs explicit bf16 operands.
    bool tf32 = false;
};
void gemm(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          float alpha, const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c,
          int64_t ldc, DType ab = DType::BF16, DType c_type = DType::BF16, GemmBatch batch = {});
// The same out of place: d = alpha op(a) op(b) + beta c_in, c_in and d of one layout (ldc, c_type,
// batch.stride_c); c_in may be an operand (Newton-Schulz's W' = B W + a W without copying W).
void gemm_out(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
              float alpha, const void* a, int64_t lda, const void* b, int64_t ldb, float beta,
              const void* c_in, void* d, int64_t ldc, DType ab, DType c_type, GemmBatch batch = {});

}  // namespace sparsetron::cuda
