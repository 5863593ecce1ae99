// The GEMM family on CUDA (cuBLASLt) against the CPU reference: every transpose and type, fp32
// and batched problems, the fp32 precision modes.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "gpu/harness.h"
#include "sparsetron/ops/gemm/gemm.h"

#if SPARSETRON_WITH_CUDA
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(GemmCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The gemm family's CUDA tests: the shared op fixture (op_fixtures.h).
class GemmCuda : public CudaOps {};

TEST_F(GemmCuda, GemmAllTransposesAndTypes) {
    for (uint64_t seed : {1, 2}) {
        const int64_t m = 97, n = 130, k = 75;
        for (int ta = 0; ta < 2; ++ta)
            for (int tb = 0; tb < 2; ++tb) {
                const int64_t lda = ta ? m + 3 : k + 5, ldb = tb ? k + 2 : n + 1, ldc = n + 4;
                Rounded a((ta ? k : m) * lda, seed * 10 + 1), b((tb ? n : k) * ldb, seed * 10 + 2);
                auto c0 = random_vector<float>(m * ldc, seed * 10 + 3);
                // fp32 output accumulating into C (beta = 1), and a bf16 output.
                DeviceArray<float> c32(c0);
                cuda::gemm(ctx(), ta, tb, m, n, k, 0.5f, a.dev, lda, b.dev, ldb, 1.f, c32, ldc,
                           DType::BF16, DType::F32);
                DeviceArray<bf16> c16(m * ldc);
                cuda::gemm(ctx(), ta, tb, m, n, k, 1.f, a.dev, lda, b.dev, ldb, 0.f, c16, ldc);
                sync();
                std::vector<float> ref32 = c0, ref16(m * ldc, 0.f);
                cpu::gemm<float>(ta, tb, m, n, k, 0.5f, a.host.data(), lda, b.host.data(), ldb, 1.f,
                                 ref32.data(), ldc);
                cpu::gemm<float>(ta, tb, m, n, k, 1.f, a.host.data(), lda, b.host.data(), ldb, 0.f,
                                 ref16.data(), ldc);
                std::vector<bool> in_c(m * ldc);
                for (int64_t i = 0; i < m * ldc; ++i) in_c[i] = i % ldc < n;
                const std::string tag = cat("gemm ta=", ta, " tb=", tb);
                expect_close(tag + " bf16->fp32 beta=1", c32.download(), ref32, kF32Tol, in_c);
                expect_close(tag + " bf16->bf16", download_f(c16), ref16, kBf16Tol, in_c);
                expect_guard(c32, tag);
                expect_guard(c16, tag);
            }
    }
}

TEST_F(GemmCuda, GemmFp32AndBatched) {
    const int64_t m = 40, n = 56, k = 33, batch = 3;
    auto a = random_vector<float>(batch * m * k, 5), b = random_vector<float>(batch * n * k, 6);
    DeviceArray<float> da(a), db(b), dc(batch * m * n);
    cuda::gemm(ctx(), false, true, m, n, k, 1.f, da, k, db, k, 0.f, dc, n, DType::F32, DType::F32,
               {batch, m * k, n * k, m * n});
    sync();
    std::vector<float> ref(batch * m * n);
    for (int64_t i = 0; i < batch; ++i)
        cpu::gemm<float>(false, true, m, n, k, 1.f, a.data() + i * m * k, k, b.data() + i * n * k,
                         k, 0.f, ref.data() + i * m * n, n);
    expect_close("gemm fp32 batched", dc.download(), ref, kF32Tol);
    expect_guard(dc, "gemm batched");
}

// fp32 GEMMs exact and with TF32 tensor cores (Muon's muon_fp32_matmul_prec): the TF32 error
// against the fp32 CPU GEMM must be TF32-sized (10-bit mantissa inputs), the exact mode's
// fp32-sized, so a mode that is not applied fails. Measured on the H200: 2.3e-7 and 2.6e-4.
TEST_F(GemmCuda, GemmFp32PrecisionModes) {
    const int64_t m = 96, n = 128, k = 512;
    auto a = random_vector<float>(m * k, 51), b = random_vector<float>(n * k, 52);
    DeviceArray<float> da(a), db(b), dc(m * n);
    std::vector<float> ref(m * n);
    cpu::gemm<float>(false, true, m, n, k, 1.f, a.data(), k, b.data(), k, 0.f, ref.data(), n);
    auto error = [&](bool tf32) {
        cuda::GemmBatch g;
        g.tf32 = tf32;
        cuda::gemm(ctx(), false, true, m, n, k, 1.f, da, k, db, k, 0.f, dc, n, DType::F32,
                   DType::F32, g);
        sync();
        const auto got = dc.download();
        double num = 0, den = 0;
        for (size_t i = 0; i < ref.size(); ++i)
            num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]),
                den += double(ref[i]) * ref[i];
        return std::sqrt(num / den);
    };
    const double exact = error(false), tf32 = error(true);
    std::cout << "[harness] fp32 GEMM normalized error: fp32 " << exact << ", tf32 " << tf32
              << "\n";
    EXPECT_LT(exact, 1e-6);
    EXPECT_GT(tf32, 1e-5);
    EXPECT_LT(tf32, 2e-3);
}

#endif  // SPARSETRON_WITH_CUDA
