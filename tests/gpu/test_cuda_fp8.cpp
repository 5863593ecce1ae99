// FP8 blockwise quantization on CUDA against the CPU reference (ops/cpu/fp8_blockwise.h): e4m3
// bytes and fp32 scales must be identical (as Transformer Engine's tests require of its
// quantizers), on shapes with partial blocks and block magnitudes 2^12 apart.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "../fp8_test_data.h"
#include "harness.h"
#include "sparsetron/ops/cpu/fp8_blockwise.h"

#if SPARSETRON_WITH_CUDA
#include "sparsetron/ops/cuda/cuda_session.h"
#include "sparsetron/ops/cuda/ops.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaFp8, Skipped) {
    GTEST_SKIP() << "built without CUDA: CUDA FP8 tests run on the GPU machine";
}
#else

namespace {

template <typename A, typename B>
int64_t mismatches(const std::vector<A>& a, const std::vector<B>& b) {
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += !(a[i] == b[i]);
    return n;
}

}  // namespace

TEST(CudaFp8, BlockwiseQuantizersMatchTheCpuReferenceBitForBit) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    for (bool pow2 : {true, false}) {
        const int64_t rows = 300, cols = 520, nb = (cols + 127) / 128, rb = (rows + 127) / 128;
        // Activations: bf16 on the device, the same rounded values on the host.
        std::vector<float> x = fp8_blocky_values(rows, cols, 11);
        DeviceArray<bf16> dx(to_bf16_rounding(x));
        DeviceArray<uint8_t> dq(rows * cols);
        DeviceArray<float> ds(rows * nb);
        cuda::quantize_fp8_1x128(session.ctx(), dx, rows, cols, cols, pow2, dq, ds);
        std::vector<uint8_t> q(size_t(rows * cols));
        std::vector<float> s(size_t(rows * nb));
        cpu::quantize_1x128(x.data(), rows, cols, cols, pow2, q.data(), s.data());
        session.synchronize();
        EXPECT_EQ(mismatches(dq.download(), q), 0) << "1x128 bytes, pow2 " << pow2;
        EXPECT_EQ(mismatches(ds.download(), s), 0) << "1x128 scales, pow2 " << pow2;
        EXPECT_TRUE(dq.guard_intact() && ds.guard_intact());
        // Weights: fp32 masters.
        const std::vector<float> w = fp8_blocky_values(rows, cols, 12);
        DeviceArray<float> dw(w);
        DeviceArray<uint8_t> dqw(rows * cols);
        DeviceArray<float> dsw(rb * nb);
        cuda::quantize_fp8_128x128(session.ctx(), dw, rows, cols, pow2, dqw, dsw);
        std::vector<uint8_t> qw(size_t(rows * cols));
        std::vector<float> sw(size_t(rb * nb));
        cpu::quantize_128x128(w.data(), rows, cols, pow2, qw.data(), sw.data());
        session.synchronize();
        EXPECT_EQ(mismatches(dqw.download(), qw), 0) << "128x128 bytes, pow2 " << pow2;
        EXPECT_EQ(mismatches(dsw.download(), sw), 0) << "128x128 scales, pow2 " << pow2;
        EXPECT_TRUE(dqw.guard_intact() && dsw.guard_intact());
        // Not trivially equal: the quantized values span many codes.
        int64_t distinct = 0;
        std::vector<bool> seen(256, false);
        for (uint8_t b : qw) {
            if (!seen[b]) ++distinct;
            seen[b] = true;
        }
        EXPECT_GT(distinct, 200);
    }
}

#endif
