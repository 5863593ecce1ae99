// FP8 blockwise scaling, the CPU reference (ops/fp8/fp8.h): the e4m3 codec, the 1x128
// and 128x128 quantizers and the block-scaled GEMM they feed.
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <vector>

#include "ops/fp8/fp8_test_data.h"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/gemm/gemm.h"

using namespace sparsetron;
using namespace sparsetron::cpu;

using test::fp8_blocky_values;

// Every finite code decodes and encodes back to itself; the largest is 448, the smallest
// subnormal 2^-9; 0x7F is NaN.
TEST(Fp8Blockwise, E4m3CodesRoundTrip) {
    int finite = 0;
    for (int c = 0; c < 256; ++c) {
        const float v = e4m3_to_float(uint8_t(c));
        if ((c & 0x7F) == 0x7F) {
            EXPECT_TRUE(std::isnan(v)) << c;
            continue;
        }
        ++finite;
        if ((c & 0x7F) == 0) continue;  // +0 and -0 both decode to 0
        EXPECT_EQ(int(e4m3_from_float(v)), c) << "value " << v;
    }
    EXPECT_EQ(finite, 254);
    EXPECT_EQ(e4m3_to_float(0x7E), 448.f);
    EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.f, -9));
    EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.f, -6));
    EXPECT_TRUE(std::isnan(e4m3_to_float(e4m3_from_float(NAN))));
}

// Rounding: nearest, ties to the even mantissa; saturation at +-448; values under half the
// smallest subnormal go to zero.
TEST(Fp8Blockwise, E4m3RoundsToNearestEvenAndSaturates) {
    // Between 1 (0x38) and 1.125 (0x39): 1.0625 is the tie -> even mantissa (1.0).
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(1.0625f)), 1.f);
    // Between 1.125 and 1.25: the tie 1.1875 goes to 1.25 (mantissa 2, even).
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(1.1875f)), 1.25f);
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(1.07f)), 1.125f);
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(-1.07f)), -1.125f);
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(447.f)), 448.f);
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(1e6f)), 448.f);
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(-1e6f)), -448.f);
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(std::ldexp(1.f, -11))), 0.f);
    EXPECT_EQ(e4m3_to_float(e4m3_from_float(std::ldexp(3.f, -11))), std::ldexp(1.f, -9));
    // Every float in a sweep lands on its nearest code (no code is closer).
    for (float x = -500.f; x <= 500.f; x += 0.37f) {
        const float got = e4m3_to_float(e4m3_from_float(x));
        if (std::fabs(x) >= 448.f) {
            EXPECT_EQ(std::fabs(got), 448.f);
            continue;
        }
        for (int c = 0; c < 256; ++c) {
            const float v = e4m3_to_float(uint8_t(c));
            if (!std::isnan(v)) {
                EXPECT_LE(std::fabs(got - x), std::fabs(v - x)) << x << " vs " << v;
            }
        }
    }
}

// Scales: 448 / amax, a power of two at or below it with pow2, 1 for an empty block.
TEST(Fp8Blockwise, ScaleFromAmax) {
    EXPECT_EQ(fp8_scale_from_amax(2.f, false), 224.f);
    EXPECT_EQ(fp8_scale_from_amax(2.f, true), 128.f);
    EXPECT_EQ(fp8_scale_from_amax(448.f, true), 1.f);
    EXPECT_EQ(fp8_scale_from_amax(0.f, true), 1.f);
    EXPECT_EQ(fp8_scale_from_amax(INFINITY, false), 1.f);
}

// 1x128 and 128x128 quantization of blocks of very different magnitudes: every element comes back
// within e4m3's half spacing of its block (3 mantissa bits: 2^-4 relative for normal values,
// 2^-10 / scale absolute below the normal range), each block's largest element lands in
// [224, 448] after scaling with pow2 scales, and shapes that do not divide by 128 work.
TEST(Fp8Blockwise, QuantizersKeepEveryBlockWithinE4m3Precision) {
    const int64_t rows = 200, cols = 300;  // partial blocks on both axes
    const std::vector<float> x = fp8_blocky_values(rows, cols, 3);
    const int64_t nb = (cols + 127) / 128, rb = (rows + 127) / 128;
    std::vector<uint8_t> q(x.size());
    std::vector<float> s1(size_t(rows * nb)), s2(size_t(rb * nb));
    auto check = [&](const std::vector<float>& sinv, bool rowwise) {
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) {
                const float si = rowwise ? sinv[size_t(r * nb + c / 128)]
                                         : sinv[size_t((r / 128) * nb + c / 128)];
                const float xv = x[size_t(r * cols + c)];
                const float back = e4m3_to_float(q[size_t(r * cols + c)]) * si;
                const float scaled = std::fabs(xv) / si;
                const float tol = scaled >= std::ldexp(1.f, -6) ? std::fabs(xv) * 0.0625f
                                                                : std::ldexp(1.f, -10) * si;
                ASSERT_LE(std::fabs(back - xv), tol * 1.0001f) << r << "," << c;
            }
    };
    quantize_1x128(x.data(), rows, cols, cols, true, q.data(), s1.data());
    check(s1, true);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            float amax = 0;
            for (int64_t c = b * 128; c < std::min(cols, b * 128 + 128); ++c)
                amax = std::max(amax, std::fabs(x[size_t(r * cols + c)]));
            const float top = amax / s1[size_t(r * nb + b)];
            EXPECT_GE(top, 224.f);
            EXPECT_LE(top, 448.f);
        }
    quantize_128x128(x.data(), rows, cols, true, q.data(), s2.data());
    check(s2, false);
}

// The block-scaled GEMM: equal (to fp64 rounding) to the GEMM of the dequantized operands, and
// within FP8's error of the unquantized fp32 GEMM (normalized error ~2^-5 for e4m3 inputs).
TEST(Fp8Blockwise, BlockScaledGemmMatchesDequantizedAndFp32) {
    const int64_t m = 96, n = 160, k = 384;
    const std::vector<float> x = fp8_blocky_values(m, k, 5), w = fp8_blocky_values(n, k, 6);
    const int64_t kb = k / 128;
    std::vector<uint8_t> qx(x.size()), qw(w.size());
    std::vector<float> sx(size_t(m * kb)), sw(size_t(((n + 127) / 128) * kb));
    quantize_1x128(x.data(), m, k, k, true, qx.data(), sx.data());
    quantize_128x128(w.data(), n, k, true, qw.data(), sw.data());
    std::vector<float> y(size_t(m * n)), yd(y.size()), yf(y.size());
    gemm_fp8_blockwise(qx.data(), sx.data(), qw.data(), sw.data(), m, n, k, y.data());
    // Dequantized operands, fp64 sums.
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
            double acc = 0;
            for (int64_t c = 0; c < k; ++c)
                acc += double(e4m3_to_float(qx[size_t(i * k + c)]) * sx[size_t(i * kb + c / 128)]) *
                       double(e4m3_to_float(qw[size_t(j * k + c)]) *
                              sw[size_t((j / 128) * kb + c / 128)]);
            yd[size_t(i * n + j)] = float(acc);
        }
    cpu::gemm<float>(false, true, m, n, k, 1.f, x.data(), k, w.data(), k, 0.f, yf.data(), n);
    double num_d = 0, num_f = 0, den = 0;
    for (size_t i = 0; i < y.size(); ++i) {
        num_d += double(y[i] - yd[i]) * double(y[i] - yd[i]);
        num_f += double(y[i] - yf[i]) * double(y[i] - yf[i]);
        den += double(yf[i]) * double(yf[i]);
    }
    const double err_d = std::sqrt(num_d / den), err_f = std::sqrt(num_f / den);
    std::cout << "[fp8 blockwise gemm] vs dequantized " << err_d << ", vs fp32 " << err_f << "\n";
    EXPECT_LT(err_d, 1e-6);
    EXPECT_LT(err_f, 0.04);
    EXPECT_GT(err_f, 1e-4) << "FP8 must lose something: the inputs were not quantized";
}

// The weight gradient's form (what fp8_recipe: blockwise runs for dW = dy^T x): dy [T, N] and
// x [T, K] quantized in 1x128 blocks along the tokens T (as the operands dy^T [N, T] and x^T
// [K, T]), both 1x128 in the GEMM with per-row scales: equal to the dequantized GEMM and within
// FP8's error of fp32 (blocks of values 2^12 apart in magnitude from one 128-token block to the
// next: one scale per operand would flush the small blocks).
TEST(Fp8Blockwise, WeightGradientFormQuantizesAlongTheTokens) {
    const int64_t T = 384, N = 96, K = 160;
    const std::vector<float> dy = fp8_blocky_values(T, N, 7), x = fp8_blocky_values(T, K, 8);
    const auto transpose = [](const std::vector<float>& a, int64_t rows, int64_t cols) {
        std::vector<float> t(a.size());
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
        return t;
    };
    const std::vector<float> dyt = transpose(dy, T, N), xt = transpose(x, T, K);
    const int64_t tb = T / 128;
    std::vector<uint8_t> qa(dyt.size()), qb(xt.size());
    std::vector<float> sa(size_t(N * tb)), sb(size_t(K * tb));
    quantize_1x128(dyt.data(), N, T, T, true, qa.data(), sa.data());
    quantize_1x128(xt.data(), K, T, T, true, qb.data(), sb.data());
    std::vector<float> dw(size_t(N * K)), dd(dw.size()), df(dw.size());
    gemm_fp8_blockwise(qa.data(), sa.data(), qb.data(), sb.data(), N, K, T, dw.data(), true);
    for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < K; ++j) {
            double acc = 0;
            for (int64_t t = 0; t < T; ++t)
                acc += double(e4m3_to_float(qa[size_t(i * T + t)]) * sa[size_t(i * tb + t / 128)]) *
                       double(e4m3_to_float(qb[size_t(j * T + t)]) * sb[size_t(j * tb + t / 128)]);
            dd[size_t(i * K + j)] = float(acc);
        }
    cpu::gemm<float>(true, false, N, K, T, 1.f, dy.data(), N, x.data(), K, 0.f, df.data(), K);
    double num_d = 0, num_f = 0, den = 0;
    for (size_t i = 0; i < dw.size(); ++i) {
        num_d += double(dw[i] - dd[i]) * double(dw[i] - dd[i]);
        num_f += double(dw[i] - df[i]) * double(dw[i] - df[i]);
        den += double(df[i]) * double(df[i]);
    }
    const double err_d = std::sqrt(num_d / den), err_f = std::sqrt(num_f / den);
    std::cout << "[fp8 weight-gradient gemm] vs dequantized " << err_d << ", vs fp32 " << err_f
              << "\n";
    EXPECT_LT(err_d, 1e-6);
    EXPECT_LT(err_f, 0.04);
    EXPECT_GT(err_f, 1e-4);
}

// The GEMM's scale layouts (ops/fp8/scale_layout.h): every block of an operand gets its own slot
// inside the buffer, rows contiguous for 1x128 and blocks of k contiguous for 128x128.
TEST(Fp8ScaleLayout, EveryBlockHasItsOwnSlot) {
    for (int64_t rows : {1, 5, 128, 300})
        for (int64_t k : {16, 128, 656}) {
            std::vector<int> used(size_t(fp8::scales_1x128(rows, k)), 0);
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t kb = 0; kb < fp8::blocks(k); ++kb)
                    ++used[size_t(fp8::scale_index_1x128(r, kb, rows))];
            EXPECT_EQ(*std::max_element(used.begin(), used.end()), 1) << rows << "x" << k;
            EXPECT_EQ(fp8::scale_index_1x128(1, 0, rows) - fp8::scale_index_1x128(0, 0, rows), 1);
            std::vector<int> used2(size_t(fp8::scales_128x128(rows, k)), 0);
            for (int64_t rb = 0; rb < fp8::blocks(rows); ++rb)
                for (int64_t kb = 0; kb < fp8::blocks(k); ++kb)
                    ++used2[size_t(fp8::scale_index_128x128(rb, kb, k))];
            EXPECT_EQ(*std::max_element(used2.begin(), used2.end()), 1) << rows << "x" << k;
        }
    // Padding to 4: 5 rows take 8 slots per block of k; 656 columns (6 blocks) 8 per block row.
    EXPECT_EQ(fp8::scales_1x128(5, 656), 6 * 8);
    EXPECT_EQ(fp8::scales_128x128(300, 656), 3 * 8);
}
