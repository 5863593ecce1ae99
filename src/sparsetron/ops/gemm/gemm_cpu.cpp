// GEMM through OpenBLAS (cblas), row-major. OpenBLAS runs single-threaded and the engine's own
// pool splits the output rows: OpenBLAS's threads spin in sched_yield between the many small GEMMs
// of a step on the tiny recipe, and fixed row blocks keep results
// independent of OpenBLAS's threading.
#include <cblas.h>

#include <mutex>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/gemm/gemm.h"

namespace sparsetron::cpu {
namespace {

void single_threaded_blas() {
    static std::once_flag once;
    std::call_once(once, [] { openblas_set_num_threads(1); });
}

void blas(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void blas(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

}  // namespace

template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
    if (m == 0 || n == 0) return;
    single_threaded_blas();
    // Blocks of 64 output rows: each block's result does not depend on how blocks are assigned.
    constexpr int64_t kRows = 64;
    const int64_t blocks = (m + kRows - 1) / kRows;
    const bool worth_splitting = m * n * k >= (int64_t{1} << 18);
    if (blocks == 1 || !worth_splitting) {
        blas(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    parallel_for(blocks, [&](int64_t bb, int64_t be) {
        for (int64_t blk = bb; blk < be; ++blk) {
            int64_t r0 = blk * kRows, rows = std::min(kRows, m - r0);
            // Row r of op(A) starts at a + r*lda (no transpose) or a + r (transposed).
            const T* a_rows = ta ? a + r0 : a + r0 * lda;
            blas(ta, tb, rows, n, k, alpha, a_rows, lda, b, ldb, beta, c + r0 * ldc, ldc);
        }
    });
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                           const double*, int64_t, double, double*, int64_t);

}  // namespace sparsetron::cpu
