// FP8 blockwise quantization on CUDA against the CPU reference (ops/fp8/fp8.h): e4m3
// bytes and fp32 scales must be identical (as Transformer Engine's tests require of its
// quantizers), on shapes with partial blocks and block magnitudes 2^12 apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpu/harness.h"
#include "ops/fp8/fp8_test_data.h"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/fp8/fp8.h"

#if SPARSETRON_WITH_CUDA
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/moe/moe.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(Fp8Cuda, Skipped) {
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

// GEMM-layout scales (ops/fp8/scale_layout.h) back to the CPU reference's [rows, blocks(k)] and
// [blocks(rows), blocks(k)].
std::vector<float> logical_1x128(const std::vector<float>& g, int64_t rows, int64_t k) {
    std::vector<float> out(size_t(rows * fp8::blocks(k)));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t kb = 0; kb < fp8::blocks(k); ++kb)
            out[size_t(r * fp8::blocks(k) + kb)] = g[size_t(fp8::scale_index_1x128(r, kb, rows))];
    return out;
}
std::vector<float> logical_128x128(const std::vector<float>& g, int64_t rows, int64_t k) {
    std::vector<float> out(size_t(fp8::blocks(rows) * fp8::blocks(k)));
    for (int64_t rb = 0; rb < fp8::blocks(rows); ++rb)
        for (int64_t kb = 0; kb < fp8::blocks(k); ++kb)
            out[size_t(rb * fp8::blocks(k) + kb)] = g[size_t(fp8::scale_index_128x128(rb, kb, k))];
    return out;
}

}  // namespace

TEST(Fp8Cuda, BlockwiseQuantizersMatchTheCpuReferenceBitForBit) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    // 520 columns: the activation quantizer's wide form (16-byte loads, a last block of 8
    // columns); 524: the warp-per-block form's 8-byte loads; 523: its element-wise path.
    for (const auto& [pow2, cols] :
         {std::pair{true, int64_t(520)}, std::pair{false, int64_t(520)},
          std::pair{true, int64_t(524)}, std::pair{true, int64_t(523)}}) {
        const int64_t rows = 300, nb = (cols + 127) / 128, rb = (rows + 127) / 128;
        // Activations: bf16 on the device, the same rounded values on the host.
        std::vector<float> x = fp8_blocky_values(rows, cols, 11);
        DeviceArray<bf16> dx(to_bf16_rounding(x));
        DeviceArray<uint8_t> dq(rows * cols);
        DeviceArray<float> ds(fp8::scales_1x128(rows, cols));
        cuda::quantize_fp8_1x128(session.ctx(), dx, rows, cols, cols, pow2, dq, ds);
        std::vector<uint8_t> q(size_t(rows * cols));
        std::vector<float> s(size_t(rows * nb));
        cpu::quantize_1x128(x.data(), rows, cols, cols, pow2, q.data(), s.data());
        session.synchronize();
        EXPECT_EQ(mismatches(dq.download(), q), 0) << "1x128 bytes, pow2 " << pow2;
        EXPECT_EQ(mismatches(logical_1x128(ds.download(), rows, cols), s), 0)
            << "1x128 scales, pow2 " << pow2;
        EXPECT_TRUE(dq.guard_intact() && ds.guard_intact());
        // Weights: fp32 masters.
        const std::vector<float> w = fp8_blocky_values(rows, cols, 12);
        DeviceArray<float> dw(w);
        DeviceArray<uint8_t> dqw(rows * cols);
        DeviceArray<float> dsw(fp8::scales_128x128(rows, cols));
        cuda::quantize_fp8_128x128(session.ctx(), dw, rows, cols, pow2, dqw, dsw);
        std::vector<uint8_t> qw(size_t(rows * cols));
        std::vector<float> sw(size_t(rb * nb));
        cpu::quantize_128x128(w.data(), rows, cols, pow2, qw.data(), sw.data());
        session.synchronize();
        EXPECT_EQ(mismatches(dqw.download(), qw), 0) << "128x128 bytes, pow2 " << pow2;
        EXPECT_EQ(mismatches(logical_128x128(dsw.download(), rows, cols), sw), 0)
            << "128x128 scales, pow2 " << pow2;
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

template <typename T>
std::vector<T> transpose(const std::vector<T>& a, int64_t rows, int64_t cols) {
    std::vector<T> t(a.size());
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
    return t;
}

// The transposed quantizers (the gradient GEMMs' operands) are the plain ones applied to the
// transpose, bit for bit: weights' 128x128 blocks written as w^T, activations' 1x128 blocks down
// the columns written as x^T. 300 rows: four-byte stores; 302: byte stores and a partial tile;
// 288 (a multiple of 32, a partial row tile): the tiled form of both orientations at once.
TEST(Fp8Cuda, TransposedQuantizersMatchTheCpuReferenceBitForBit) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    for (const auto& [rows, cols] :
         {std::pair{int64_t(300), int64_t(520)}, std::pair{int64_t(302), int64_t(523)},
          std::pair{int64_t(288), int64_t(520)}}) {
        std::vector<float> x = fp8_blocky_values(rows, cols, 31);
        const std::vector<float> xr = to_float(to_bf16_rounding(x));
        DeviceArray<bf16> dx(to_bf16_rounding(x));
        DeviceArray<uint8_t> dq(rows * cols);
        DeviceArray<float> ds(fp8::scales_1x128(cols, rows));
        cuda::quantize_fp8_1x128_columns(session.ctx(), dx, rows, cols, cols, true, dq, ds);
        const std::vector<float> xt = transpose(xr, rows, cols);
        std::vector<uint8_t> q(size_t(rows * cols));
        std::vector<float> sc(size_t(cols * fp8::blocks(rows)));
        cpu::quantize_1x128(xt.data(), cols, rows, rows, true, q.data(), sc.data());
        session.synchronize();
        EXPECT_EQ(mismatches(dq.download(), q), 0) << "1x128 down columns, bytes, rows " << rows;
        EXPECT_EQ(mismatches(logical_1x128(ds.download(), cols, rows), sc), 0)
            << "1x128 down columns, scales, rows " << rows;
        EXPECT_TRUE(dq.guard_intact() && ds.guard_intact());

        const std::vector<float> w = fp8_blocky_values(rows, cols, 32);
        DeviceArray<float> dw(w);
        DeviceArray<uint8_t> dqw(rows * cols);
        DeviceArray<float> dsw(fp8::scales_128x128(cols, rows));
        cuda::quantize_fp8_128x128(session.ctx(), dw, rows, cols, false, dqw, dsw, true);
        const std::vector<float> wt = transpose(w, rows, cols);
        std::vector<uint8_t> qw(size_t(rows * cols));
        std::vector<float> sw(size_t(fp8::blocks(cols) * fp8::blocks(rows)));
        cpu::quantize_128x128(wt.data(), cols, rows, false, qw.data(), sw.data());
        session.synchronize();
        EXPECT_EQ(mismatches(dqw.download(), qw), 0) << "128x128 transposed, bytes, rows " << rows;
        EXPECT_EQ(mismatches(logical_128x128(dsw.download(), cols, rows), sw), 0)
            << "128x128 transposed, scales, rows " << rows;
        EXPECT_TRUE(dqw.guard_intact() && dsw.guard_intact());
        // Both orientations from one read (what the FP8 linears quantize every step).
        DeviceArray<uint8_t> bq(rows * cols), bqt(rows * cols);
        DeviceArray<float> bs(fp8::scales_128x128(rows, cols)),
            bst(fp8::scales_128x128(cols, rows));
        cuda::quantize_fp8_128x128_both(session.ctx(), dw, rows, cols, false, bq, bs, bqt, bst);
        std::vector<uint8_t> q0(size_t(rows * cols));
        std::vector<float> s0(size_t(fp8::blocks(rows) * fp8::blocks(cols)));
        cpu::quantize_128x128(w.data(), rows, cols, false, q0.data(), s0.data());
        session.synchronize();
        EXPECT_EQ(mismatches(bq.download(), q0), 0) << "both: W bytes, rows " << rows;
        EXPECT_EQ(mismatches(logical_128x128(bs.download(), rows, cols), s0), 0)
            << "both: W scales";
        EXPECT_EQ(mismatches(bqt.download(), qw), 0) << "both: W^T bytes, rows " << rows;
        EXPECT_EQ(mismatches(logical_128x128(bst.download(), cols, rows), sw), 0)
            << "both: W^T scales";
        EXPECT_TRUE(bq.guard_intact() && bqt.guard_intact() && bs.guard_intact() &&
                    bst.guard_intact());
    }
}

// The experts' weight-gradient operands (quantize_fp8_1x128_expert_columns): each expert's rows
// transposed into its own 128-aligned segment of x^T, zero-padded, and quantized down the columns
// as the plain quantizer does the expert's rows alone, bit for bit (bytes of every segment,
// padding included, and every block's scale); an empty expert takes no segment; rows past the
// last expert (NaN here) are never read; bytes past the last segment are left as they were.
// 200 columns: a partial column tile.
TEST(Fp8Cuda, ExpertColumnQuantizerMatchesTheCpuReferencePerSegment) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const std::vector<int32_t> offsets = {0, 300, 300, 517, 700};
    const int64_t E = 4, capacity = 760, cols = 200;
    const int64_t padded = fp8::expert_columns_padded(offsets.back(), E);
    std::vector<float> x = fp8_blocky_values(capacity, cols, 35);
    for (int64_t i = offsets.back() * cols; i < capacity * cols; ++i) x[size_t(i)] = NAN;
    const std::vector<float> xr = to_float(to_bf16_rounding(x));
    DeviceArray<bf16> dx(to_bf16_rounding(x));
    DeviceArray<int32_t> doff(offsets);
    const std::vector<uint8_t> before(size_t(cols * padded), uint8_t(0x5A));
    DeviceArray<uint8_t> dq(before);
    DeviceArray<float> ds(fp8::scales_1x128(cols, padded));
    cuda::quantize_fp8_1x128_expert_columns(session.ctx(), dx, doff, E, cols, cols, padded, true,
                                            dq, ds);
    session.synchronize();
    const std::vector<uint8_t> q = dq.download();
    const std::vector<float> sc = ds.download();
    int64_t start = 0, bad_bytes = 0, bad_scales = 0;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = offsets[size_t(e)], rows = offsets[size_t(e) + 1] - r0;
        const int64_t span = (rows + 127) / 128 * 128;
        if (span == 0) continue;
        std::vector<float> xt(size_t(cols * span), 0.f);  // the segment, zero-padded
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c)
                xt[size_t(c * span + r)] = xr[size_t((r0 + r) * cols + c)];
        std::vector<uint8_t> qe(size_t(cols * span));
        std::vector<float> se(size_t(cols * (span / 128)));
        cpu::quantize_1x128(xt.data(), cols, span, span, true, qe.data(), se.data());
        for (int64_t c = 0; c < cols; ++c) {
            for (int64_t r = 0; r < span; ++r)
                bad_bytes += q[size_t(c * padded + start + r)] != qe[size_t(c * span + r)];
            for (int64_t b = 0; b < span / 128; ++b)
                bad_scales += sc[size_t(fp8::scale_index_1x128(c, start / 128 + b, cols))] !=
                              se[size_t(c * (span / 128) + b)];
        }
        start += span;
    }
    EXPECT_EQ(start, 896);  // 384 + 256 + 256
    EXPECT_LE(start, padded);
    EXPECT_EQ(bad_bytes, 0);
    EXPECT_EQ(bad_scales, 0);
    int64_t touched = 0;
    for (int64_t c = 0; c < cols; ++c)
        for (int64_t r = start; r < padded; ++r) touched += q[size_t(c * padded + r)] != 0x5A;
    EXPECT_EQ(touched, 0) << "bytes past the last segment were written";
    EXPECT_TRUE(dq.guard_intact() && ds.guard_intact());
}

// A batch of matrices in one launch (a layer's experts from their masters, one parameter stride
// apart with other parameters between them): each matrix's W and W^T, packed matrix after matrix,
// equal to the CPU reference's. Strides a multiple of four floats take the tiled kernel (one
// grid over the batch), odd ones the untiled kernel a matrix at a time; both must match.
TEST(Fp8Cuda, BatchedWeightQuantizerMatchesTheCpuReferencePerMatrix) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const int64_t rows = 288, cols = 392, count = 3, elems = rows * cols;
    const int64_t sc = fp8::scales_128x128(rows, cols), sct = fp8::scales_128x128(cols, rows);
    for (const int64_t stride : {elems + 4 * 37, elems + 3}) {
        std::vector<float> masters(size_t(stride * count), 0.f);
        for (int64_t m = 0; m < count; ++m) {
            const std::vector<float> w = fp8_blocky_values(rows, cols, uint64_t(40 + m));
            std::copy(w.begin(), w.end(), masters.begin() + m * stride);
            std::fill(masters.begin() + m * stride + elems,  // a neighbour the batch must not read
                      masters.begin() + std::min((m + 1) * stride, stride * count), 1e4f);
        }
        DeviceArray<float> dw(masters);
        DeviceArray<uint8_t> q(count * elems), qt(count * elems);
        DeviceArray<float> s(count * sc), st(count * sct);
        cuda::quantize_fp8_128x128_both(session.ctx(), dw, rows, cols, true, q, s, qt, st, count,
                                        stride);
        session.synchronize();
        const std::vector<uint8_t> hq = q.download(), hqt = qt.download();
        const std::vector<float> hs = s.download(), hst = st.download();
        for (int64_t m = 0; m < count; ++m) {
            const std::vector<float> w(masters.begin() + m * stride,
                                       masters.begin() + m * stride + elems);
            const std::vector<float> wt = transpose(w, rows, cols);
            std::vector<uint8_t> q0(static_cast<size_t>(elems)), q1(q0.size());
            std::vector<float> s0(size_t(fp8::blocks(rows) * fp8::blocks(cols))), s1(s0.size());
            cpu::quantize_128x128(w.data(), rows, cols, true, q0.data(), s0.data());
            cpu::quantize_128x128(wt.data(), cols, rows, true, q1.data(), s1.data());
            const std::string at =
                "stride " + std::to_string(stride) + ", matrix " + std::to_string(m);
            // Matrix m's share of a packed output: `each` values per matrix.
            auto part = [m](const auto& all, int64_t each) {
                return std::vector<typename std::decay_t<decltype(all)>::value_type>(
                    all.begin() + m * each, all.begin() + (m + 1) * each);
            };
            EXPECT_EQ(mismatches(part(hq, elems), q0), 0) << "W bytes, " << at;
            EXPECT_EQ(mismatches(logical_128x128(part(hs, sc), rows, cols), s0), 0)
                << "W scales, " << at;
            EXPECT_EQ(mismatches(part(hqt, elems), q1), 0) << "W^T bytes, " << at;
            EXPECT_EQ(mismatches(logical_128x128(part(hst, sct), cols, rows), s1), 0)
                << "W^T scales, " << at;
        }
        EXPECT_TRUE(q.guard_intact() && qt.guard_intact() && s.guard_intact() && st.guard_intact());
    }
}

// cuBLASLt's block-scaled GEMM against the CPU reference on the same quantized operands (the
// CUDA quantizers' output): x [m, k] 1x128, w [n, k] 128x128 (the forward) and 1x128 (the
// gradient GEMMs), with a partial last block of k and accumulation into y. The GEMM sums the
// 128-wide blocks in fp32 and rounds y to bf16: within 1% of the reference value plus 1e-3 of
// the output's rms. The scales matter: blocks 2^12 apart in magnitude.
TEST(Fp8Cuda, BlockScaledGemmMatchesTheCpuReference) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const int64_t m = 264, n = 392, k = 656;
    // bf16-representable values: the 1x128 quantizer reads bf16, the 128x128 one fp32.
    std::vector<float> x = fp8_blocky_values(m, k, 21), w = fp8_blocky_values(n, k, 22);
    DeviceArray<bf16> dx(to_bf16_rounding(x)), dwb(to_bf16_rounding(w));
    DeviceArray<float> dw(w);
    DeviceArray<uint8_t> qx(m * k), qw(n * k), qw1(n * k);
    DeviceArray<float> sx(fp8::scales_1x128(m, k)), sw(fp8::scales_128x128(n, k)),
        sw1(fp8::scales_1x128(n, k));
    const ExecContext& ctx = session.ctx();
    cuda::quantize_fp8_1x128(ctx, dx, m, k, k, true, qx, sx);
    cuda::quantize_fp8_128x128(ctx, dw, n, k, true, qw, sw);
    cuda::quantize_fp8_1x128(ctx, dwb, n, k, k, true, qw1, sw1);
    session.synchronize();  // the session's stream is non-blocking: downloads do not wait for it
    const std::vector<uint8_t> hqx = qx.download(), hqw = qw.download(), hqw1 = qw1.download();
    const std::vector<float> hsx = logical_1x128(sx.download(), m, k);
    const std::vector<float> hsw = logical_128x128(sw.download(), n, k);
    const std::vector<float> hsw1 = logical_1x128(sw1.download(), n, k);
    // The reference of the 128x128 case (cpu::gemm_fp8_blockwise); the 1x128 x 1x128 case by the
    // same sum with w's per-row scales.
    std::vector<float> ref(size_t(m * n)), ref1(size_t(m * n)), exact(size_t(m * n));
    cpu::gemm_fp8_blockwise(hqx.data(), hsx.data(), hqw.data(), hsw.data(), m, n, k, ref.data());
    const int64_t kb_n = fp8::blocks(k);
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
            double acc = 0, e = 0;
            for (int64_t kb = 0; kb < kb_n; ++kb) {
                double part = 0;
                for (int64_t c = kb * 128; c < std::min(k, kb * 128 + 128); ++c) {
                    part += double(cpu::e4m3_to_float(hqx[size_t(i * k + c)])) *
                            double(cpu::e4m3_to_float(hqw1[size_t(j * k + c)]));
                    e += double(x[size_t(i * k + c)]) * double(w[size_t(j * k + c)]);
                }
                acc += part * hsx[size_t(i * kb_n + kb)] * hsw1[size_t(j * kb_n + kb)];
            }
            ref1[size_t(i * n + j)] = float(acc);
            exact[size_t(i * n + j)] = float(e);
        }
    auto check = [&](const std::vector<float>& got, const std::vector<float>& want,
                     const std::string& what) {
        double rms = 0, err = 0, qerr = 0, den = 0;
        for (size_t i = 0; i < want.size(); ++i) rms += double(want[i]) * want[i];
        rms = std::sqrt(rms / double(want.size()));
        int64_t bad = 0;
        for (size_t i = 0; i < want.size(); ++i) {
            const double d = std::fabs(double(got[i]) - want[i]);
            if (!(d <= 1e-2 * std::fabs(want[i]) + 1e-3 * rms)) ++bad;  // NaN is bad
            err += d * d;
            qerr += (double(want[i]) - exact[i]) * (double(want[i]) - exact[i]);
            den += double(exact[i]) * exact[i];
        }
        std::cout << "[fp8 gemm] " << what << ": |gpu - reference| / |reference| "
                  << std::sqrt(err / (rms * rms * double(want.size())))
                  << ", reference vs the unquantized product " << std::sqrt(qerr / den) << "\n";
        EXPECT_EQ(bad, 0) << what;
    };
    DeviceArray<bf16> y(m * n);
    cuda::gemm_fp8_blockwise(ctx, m, n, k, {qx, sx, false}, {qw, sw, true}, y, n);
    session.synchronize();
    check(to_float(y.download()), ref, "x 1x128 . w 128x128");
    cuda::gemm_fp8_blockwise(ctx, m, n, k, {qx, sx, false}, {qw1, sw1, false}, y, n);
    session.synchronize();
    check(to_float(y.download()), ref1, "x 1x128 . w 1x128");
    // Accumulate: y (the 1x128 result) + the 128x128 product.
    const std::vector<float> y1 = to_float(y.download());
    cuda::gemm_fp8_blockwise(ctx, m, n, k, {qx, sx, false}, {qw, sw, true}, y, n, true);
    session.synchronize();
    std::vector<float> sum(ref.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = y1[i] + ref[i];
    check(to_float(y.download()), sum, "accumulate");
    EXPECT_THROW(cuda::gemm_fp8_blockwise(ctx, m, n, k, {qx, sx, true}, {qw, sw, true}, y, n),
                 Error);
    // A row count cuBLASLt's block-scaled kernels do not take (33) stops naming the shape.
    try {
        cuda::gemm_fp8_blockwise(ctx, 33, n, k, {qx, sx, false}, {qw, sw, true}, y, n);
        ADD_FAILURE() << "m = 33 ran";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("does not take m=33"), std::string::npos) << e.what();
    }
    // fp32 output accumulated onto existing values (weight gradients): y32 = y0 + x . w (1x128).
    const std::vector<float> y0 = fp8_blocky_values(m, n, 23);
    DeviceArray<float> y32(y0);
    cuda::gemm_fp8_blockwise(ctx, m, n, k, {qx, sx, false}, {qw1, sw1, false},
                             static_cast<float*>(y32), n, true);
    session.synchronize();
    std::vector<float> acc(ref1.size());
    for (size_t i = 0; i < acc.size(); ++i) acc[i] = y0[i] + ref1[i];
    check(y32.download(), acc, "fp32 output, accumulated");
    EXPECT_TRUE(y32.guard_intact());
}

// The routed experts' FP8 grouped GEMM (grouped_gemm_fp8) against the CPU reference expert by
// expert, on the CUDA quantizers' output: uneven routing with an empty expert and experts ending
// inside a 128-row tile, a partial last tile of n and of k, rows in the buffer past the last
// expert (never written), the persistent grid capped at 3 blocks (every block's stage ring wraps
// across tiles) and uncapped, and accumulation into y; both consumer forms (serial, and the
// next slice's MMAs overlapping this one's scaling). Each expert's weights in the magnitudes of
// another block pattern: a wrong expert's weights or scales would be off by up to 2^12.
TEST(Fp8Cuda, GroupedExpertGemmMatchesTheCpuReferencePerExpert) {
    REQUIRE_GPU();
    if (!cuda::grouped_gemm_fp8_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs sm_90a";
    cuda::CudaSession session;
    const int64_t E = 4, n = 296, k = 656, capacity = 760;
    const std::vector<int32_t> offsets = {0, 300, 300, 517, 700};
    std::vector<float> x = fp8_blocky_values(capacity, k, 31);
    DeviceArray<bf16> dx(to_bf16_rounding(x));
    DeviceArray<uint8_t> qx(capacity * k), qw(E * n * k);
    DeviceArray<float> sx(fp8::scales_1x128(capacity, k)), sw(E * fp8::scales_128x128(n, k));
    const ExecContext& ctx = session.ctx();
    cuda::quantize_fp8_1x128(ctx, dx, capacity, k, k, true, qx, sx);
    std::vector<std::vector<float>> w(E);
    for (int64_t e = 0; e < E; ++e) {
        w[size_t(e)] = fp8_blocky_values(n, k, 40 + uint64_t(e));
        DeviceArray<float> dw(w[size_t(e)]);
        cuda::quantize_fp8_128x128(ctx, dw, n, k, true, qw.get() + e * n * k,
                                   sw.get() + e * fp8::scales_128x128(n, k));
        session.synchronize();  // the stream is non-blocking: done before dw goes
    }
    const std::vector<uint8_t> hqx = qx.download(), hqw = qw.download();
    const std::vector<float> hsx = logical_1x128(sx.download(), capacity, k),
                             hsw_all = sw.download();
    std::vector<float> ref(size_t(capacity * n), 0.f);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = offsets[size_t(e)], rows = offsets[size_t(e) + 1] - r0;
        if (rows == 0) continue;
        const std::vector<float> packed(hsw_all.begin() + e * fp8::scales_128x128(n, k),
                                        hsw_all.begin() + (e + 1) * fp8::scales_128x128(n, k));
        const std::vector<float> hsw = logical_128x128(packed, n, k);
        cpu::gemm_fp8_blockwise(hqx.data() + r0 * k, hsx.data() + r0 * fp8::blocks(k),
                                hqw.data() + e * n * k, hsw.data(), rows, n, k,
                                ref.data() + r0 * n);
    }
    const int64_t used = offsets.back();
    const std::vector<float> before = fp8_blocky_values(capacity, n, 33);
    std::vector<float> start = before;
    DeviceArray<int32_t> doff(offsets);
    auto check = [&](const std::vector<float>& got, const std::vector<float>& want,
                     const std::string& what) {
        double rms = 0;
        for (int64_t i = 0; i < used * n; ++i) rms += double(want[size_t(i)]) * want[size_t(i)];
        rms = std::sqrt(rms / double(used * n));
        int64_t bad = 0, touched = 0;
        // A NaN fails the comparison's negation, not the comparison: it counts as bad.
        for (int64_t i = 0; i < used * n; ++i)
            bad += !(std::fabs(double(got[size_t(i)]) - want[size_t(i)]) <=
                     1e-2 * std::fabs(want[size_t(i)]) + 1e-3 * rms);
        for (int64_t i = used * n; i < capacity * n; ++i)
            touched += got[size_t(i)] != start[size_t(i)];
        EXPECT_EQ(bad, 0) << what;
        EXPECT_EQ(touched, 0) << what << ": rows past the last expert were written";
    };
    auto problem = [&](bf16* y, bool accumulate) {
        return cuda::Fp8GroupedGemm{doff,           E, 512,       capacity, n, k, {qx, sx, false},
                                    {qw, sw, true}, y, accumulate};
    };
    for (const int blocks : {3, 0}) {
        const std::string how = cat(blocks, " blocks");
        DeviceArray<bf16> y(to_bf16_rounding(start));
        cuda::grouped_gemm_fp8(ctx, problem(y, false), blocks);
        session.synchronize();  // downloads do not wait for the session's stream
        const std::vector<float> got = to_float(y.download());
        check(got, ref, "written, " + how);
        // y += the product again: 2x the reference where written.
        cuda::grouped_gemm_fp8(ctx, problem(y, true), blocks);
        session.synchronize();
        std::vector<float> twice(ref.size());
        for (size_t i = 0; i < ref.size(); ++i) twice[i] = got[i] + ref[i];
        check(to_float(y.download()), twice, "accumulated, " + how);
        EXPECT_TRUE(y.guard_intact());
    }
    cuda::Fp8GroupedGemm wrong = problem(nullptr, false);
    wrong.w.blocks_128x128 = false;  // the expert weights must have 128x128 scales
    EXPECT_THROW(cuda::grouped_gemm_fp8(ctx, wrong), Error);
}

// The routed experts' weight gradients in FP8 (grouped_gemm_fp8_weight_grad) against the CPU
// reference expert by expert: dy and x quantized per expert segment along the tokens on the GPU
// (quantize_fp8_1x128_expert_columns, checked bit for bit above), the CPU's blockwise product of
// the same bytes and scales (both operands 1x128 along the tokens). Uneven routing with an empty
// expert (zeros written where not accumulating) and segments ending inside a 128-token slice, n
// with an odd count of 128-row tiles and a partial one, a partial last column tile, the grid
// capped at 2 blocks (the ring wraps across tiles and experts) and uncapped, fp32 gradients
// written then added to, and a bf16 gradient buffer. Magnitudes differ by up to 2^12 between
// blocks, so a wrong scale, segment or expert is far outside the tolerance.
TEST(Fp8Cuda, ExpertWeightGradientMatchesTheCpuReferencePerExpert) {
    REQUIRE_GPU();
    if (!cuda::grouped_gemm_fp8_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs sm_90a";
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    const std::vector<int32_t> offsets = {0, 300, 300, 517, 700};
    const int64_t E = 4, capacity = 760, n = 296, k = 200;
    const int64_t padded = fp8::expert_columns_padded(offsets.back(), E);
    std::vector<float> dy = fp8_blocky_values(capacity, n, 36),
                       x = fp8_blocky_values(capacity, k, 37);
    DeviceArray<bf16> ddy(to_bf16_rounding(dy)), dx(to_bf16_rounding(x));
    DeviceArray<int32_t> doff(offsets);
    DeviceArray<uint8_t> qdy(n * padded), qx(k * padded);
    DeviceArray<float> sdy(fp8::scales_1x128(n, padded)), sx(fp8::scales_1x128(k, padded));
    cuda::quantize_fp8_1x128_expert_columns(ctx, ddy, doff, E, n, n, padded, true, qdy, sdy);
    cuda::quantize_fp8_1x128_expert_columns(ctx, dx, doff, E, k, k, padded, true, qx, sx);
    session.synchronize();
    const std::vector<uint8_t> hqdy = qdy.download(), hqx = qx.download();
    const std::vector<float> hsdy = sdy.download(), hsx = sx.download();
    // The reference: per expert, its segment's bytes and scales (logical layouts) into the CPU's
    // blockwise GEMM with both operands 1x128 along the tokens.
    std::vector<float> ref(size_t(E * n * k), 0.f), mag(ref.size(), 0.f);
    int64_t start = 0;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t rows = offsets[size_t(e) + 1] - offsets[size_t(e)];
        const int64_t span = (rows + 127) / 128 * 128, nb = span / 128;
        if (span == 0) continue;
        auto segment = [&](const std::vector<uint8_t>& q, const std::vector<float>& sc,
                           int64_t width, std::vector<uint8_t>& qs, std::vector<float>& ss) {
            qs.resize(size_t(width * span)), ss.resize(size_t(width * nb));
            for (int64_t c = 0; c < width; ++c) {
                for (int64_t r = 0; r < span; ++r)
                    qs[size_t(c * span + r)] = q[size_t(c * padded + start + r)];
                for (int64_t b = 0; b < nb; ++b)
                    ss[size_t(c * nb + b)] =
                        sc[size_t(fp8::scale_index_1x128(c, start / 128 + b, width))];
            }
        };
        std::vector<uint8_t> qa, qb;
        std::vector<float> sa, sb;
        segment(hqdy, hsdy, n, qa, sa);
        segment(hqx, hsx, k, qb, sb);
        cpu::gemm_fp8_blockwise(qa.data(), sa.data(), qb.data(), sb.data(), n, k, span,
                                ref.data() + e * n * k, /*w_1x128=*/true);
        // The same sum over the products' magnitudes (the codes' sign bits cleared): what the
        // tensor cores' accumulation error scales with.
        for (auto* q : {&qa, &qb})
            for (uint8_t& c : *q) c &= 0x7F;
        cpu::gemm_fp8_blockwise(qa.data(), sa.data(), qb.data(), sb.data(), n, k, span,
                                mag.data() + e * n * k, /*w_1x128=*/true);
        start += span;
    }
    // The tensor cores sum a slice's e4m3 products with fewer bits than fp32 (DeepSeek-V3 reports
    // about 14 on Hopper; the promotion per 128-deep slice bounds it): an element's error is
    // bounded by 2^-10 of its products' magnitude sum `mag` (x `times`: the added case sums two),
    // plus `rel` of the value (the bf16 gradient's rounding). A wrong scale, segment or expert
    // errs by a fraction of the value itself, most elements far above that bound; an empty
    // expert's zeros must be exact.
    auto count_bad = [&](const std::vector<float>& got, const std::vector<float>& want,
                         double times, double rel) {
        int64_t bad = 0;
        double worst = 0;
        for (size_t i = 0; i < want.size(); ++i) {
            const double err = std::fabs(double(got[i]) - want[i]);
            const double bound = std::ldexp(times * mag[i], -10) + rel * std::fabs(want[i]);
            bad += !(err <= bound);
            if (mag[i] > 0) worst = std::max(worst, err / (times * mag[i]));
        }
        std::cout << "[fp8 wgrad] worst error / magnitude sum " << worst << "\n";
        return bad;
    };
    auto problem = [&](void* dw, DType type, bool accumulate) {
        cuda::Fp8GroupedWeightGrad g;
        g.offsets = doff, g.experts = E, g.n = n, g.k = k, g.padded = padded;
        g.dyt = {qdy, sdy, false}, g.xt = {qx, sx, false};
        g.dw = dw, g.grad_type = type, g.accumulate = accumulate;
        return g;
    };
    std::vector<float> start_dw = fp8_blocky_values(E * n, k, 38);
    for (const int blocks : {2, 0}) {
        DeviceArray<float> dw(start_dw);
        cuda::grouped_gemm_fp8_weight_grad(ctx, problem(dw, DType::F32, false), blocks);
        session.synchronize();
        const std::vector<float> got = dw.download();
        EXPECT_EQ(count_bad(got, ref, 1, 0), 0) << "written, " << blocks << " blocks";
        cuda::grouped_gemm_fp8_weight_grad(ctx, problem(dw, DType::F32, true), blocks);
        session.synchronize();
        std::vector<float> twice(ref.size());
        for (size_t i = 0; i < ref.size(); ++i) twice[i] = 2 * ref[i];
        EXPECT_EQ(count_bad(dw.download(), twice, 2, 0), 0) << "added, " << blocks << " blocks";
        EXPECT_TRUE(dw.guard_intact());
    }
    DeviceArray<bf16> dwb(to_bf16_rounding(start_dw));
    cuda::grouped_gemm_fp8_weight_grad(ctx, problem(dwb, DType::BF16, false));
    session.synchronize();
    const std::vector<float> gotb = to_float(dwb.download());
    EXPECT_EQ(count_bad(gotb, ref, 1, std::ldexp(1.0, -8)), 0) << "bf16 gradient";
    EXPECT_TRUE(dwb.guard_intact());
}

// The kernels that produce the routed experts' FP8 GEMM inputs (the gather, the SwiGLU forward
// and backward, the combine backward) write the FP8 copy of their bf16 output in the same pass:
// bit for bit the bf16 kernel followed by quantize_fp8_1x128 (bytes and scales of every row
// written; where fused, nothing past them), the bf16 outputs unchanged. 384 columns: three whole
// blocks (the fused kernels); 200: the fallback (the bf16 kernel, then the quantizer).
TEST(Fp8Cuda, MoeProducersWriteTheFp8CopyOfTheirOutput) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    const int64_t T = 6, k = 2, E = 3, capacity = 14, used = 11;
    const std::vector<int32_t> offsets = {0, 5, 5, int32_t(used)};  // an empty expert
    // Every kept row once; one (token, choice) dropped.
    const std::vector<int32_t> slot_row = {3, 7, 0, -1, 10, 1, 5, 8, 2, 9, 6, 4};
    std::vector<int32_t> perm_token(size_t(capacity), 0);
    std::vector<float> gates(size_t(T * k));
    for (int64_t i = 0; i < T * k; ++i) {
        if (slot_row[size_t(i)] >= 0) perm_token[size_t(slot_row[size_t(i)])] = int32_t(i / k);
        gates[size_t(i)] = 0.3f + 0.37f * float(i);
    }
    DeviceArray<int32_t> doff(offsets), dslot(slot_row), dperm(perm_token);
    DeviceArray<float> dgates(gates);
    for (const int64_t dim : {int64_t(384), int64_t(200)}) {
        const bool fused = dim % 128 == 0;
        const int64_t nq = capacity * dim, ns = fp8::scales_1x128(capacity, dim);
        struct Copy {
            Copy(int64_t nq, int64_t ns) : q(nq), s(ns) {}
            DeviceArray<uint8_t> q;
            DeviceArray<float> s;
        };
        auto copy = [&] { return std::make_unique<Copy>(nq, ns); };
        auto out8 = [&](Copy& c) { return cuda::Fp8RowsOut{c.q, c.s, capacity, true}; };
        auto quantize = [&](const bf16* x, Copy& c) {
            cuda::quantize_fp8_1x128(ctx, x, capacity, dim, dim, true, c.q, c.s);
        };
        auto bf16_rows = [&](const DeviceArray<bf16>& a, int64_t rows) {
            std::vector<float> v = to_float(a.download());
            v.resize(size_t(rows * dim));
            return v;
        };
        // Fused copy a against the separate quantization b over the first `rows` rows.
        auto same = [&](Copy& a, Copy& b, int64_t rows, const std::string& what) {
            session.synchronize();
            const std::vector<uint8_t> qa = a.q.download(), qb = b.q.download();
            const std::vector<float> sa = a.s.download(), sb = b.s.download();
            int64_t bytes = 0, scales = 0, past = 0;
            for (int64_t i = 0; i < rows * dim; ++i) bytes += qa[size_t(i)] != qb[size_t(i)];
            for (int64_t i = rows * dim; i < nq; ++i) past += qa[size_t(i)] != 0xFF;
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t kb = 0; kb < fp8::blocks(dim); ++kb) {
                    const size_t at = size_t(fp8::scale_index_1x128(r, kb, capacity));
                    scales += !(sa[at] == sb[at]);
                }
            std::vector<bool> seen(256, false);
            int64_t distinct = 0;
            for (int64_t i = 0; i < rows * dim; ++i) {
                distinct += !seen[qa[size_t(i)]];
                seen[qa[size_t(i)]] = true;
            }
            EXPECT_EQ(bytes, 0) << what << ", dim " << dim;
            EXPECT_EQ(scales, 0) << what << " scales, dim " << dim;
            if (fused) {
                EXPECT_EQ(past, 0) << what << ": bytes past the rows written";
            }
            EXPECT_GT(distinct, 100) << what;
            EXPECT_TRUE(a.q.guard_intact() && a.s.guard_intact());
        };
        std::vector<float> x = fp8_blocky_values(T, dim, 51),
                           g = fp8_blocky_values(capacity, dim, 52),
                           u = fp8_blocky_values(capacity, dim, 53),
                           d = fp8_blocky_values(capacity, dim, 54),
                           dy = fp8_blocky_values(T, dim, 55);
        DeviceArray<bf16> dx(to_bf16_rounding(x)), dg(to_bf16_rounding(g)), du(to_bf16_rounding(u)),
            dd(to_bf16_rounding(d)), ddy(to_bf16_rounding(dy));

        // Gather: rows [0, used) written.
        DeviceArray<bf16> gp(nq), gf(nq);
        auto gq = copy(), gq8 = copy();
        cuda::moe_gather(ctx, dx, dperm, doff, E, capacity, dim, gp);
        quantize(gp, *gq);
        cuda::moe_gather(ctx, dx, dperm, doff, E, capacity, dim, gf, out8(*gq8));
        same(*gq8, *gq, used, "gather");
        EXPECT_EQ(bf16_rows(gf, used), bf16_rows(gp, used)) << "gather rows, dim " << dim;

        // SwiGLU forward: every row.
        DeviceArray<bf16> ap(nq), af(nq);
        auto aq = copy(), aq8 = copy();
        cuda::swiglu_forward(ctx, dg, du, nq, ap);
        quantize(ap, *aq);
        cuda::swiglu_forward(ctx, dg, du, capacity, dim, af, out8(*aq8));
        same(*aq8, *aq, capacity, "swiglu forward");
        EXPECT_EQ(bf16_rows(af, capacity), bf16_rows(ap, capacity)) << "swiglu, dim " << dim;

        // SwiGLU backward: both gradients.
        DeviceArray<bf16> dgp(nq), dup(nq), dgf(nq), duf(nq);
        auto dgq = copy(), duq = copy(), dgq8 = copy(), duq8 = copy();
        cuda::swiglu_backward(ctx, dg, du, dd, nq, dgp, dup);
        quantize(dgp, *dgq);
        quantize(dup, *duq);
        cuda::swiglu_backward(ctx, dg, du, dd, capacity, dim, dgf, duf, out8(*dgq8), out8(*duq8));
        same(*dgq8, *dgq, capacity, "swiglu backward, gate");
        same(*duq8, *duq, capacity, "swiglu backward, up");
        EXPECT_EQ(bf16_rows(dgf, capacity), bf16_rows(dgp, capacity)) << "dgate, dim " << dim;
        EXPECT_EQ(bf16_rows(duf, capacity), bf16_rows(dup, capacity)) << "dup, dim " << dim;

        // Combine backward: the kept rows, and the same gate gradients.
        DeviceArray<bf16> cp(nq), cf(nq);
        DeviceArray<float> gp32(T * k), gf32(T * k);
        auto cq = copy(), cq8 = copy();
        cuda::moe_combine_backward(ctx, ddy, dg, dslot, dgates, T, k, dim, cp, gp32);
        quantize(cp, *cq);
        cuda::moe_combine_backward(ctx, ddy, dg, dslot, dgates, T, k, dim, cf, gf32, out8(*cq8));
        same(*cq8, *cq, used, "combine backward");
        EXPECT_EQ(bf16_rows(cf, used), bf16_rows(cp, used)) << "combine backward, dim " << dim;
        EXPECT_EQ(gf32.download(), gp32.download()) << "gate gradients, dim " << dim;
    }
}

#endif
