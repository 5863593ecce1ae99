// Batched Muon on CUDA (label gpu) against the CPU Newton-Schulz in fp64: per-head slices,
// strided per-projection slices and tall (transposed) matrices from two clipping groups, in
// each matmul precision. The error must be the precision's size, so a mode that is not applied
// (or a mis-gathered row) fails.
#include <gtest/gtest.h>

#include <algorithm>

#include <array>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <tuple>

#include "gpu/harness.h"
#include "sparsetron/optim/muon.h"
#include "sparsetron/optim/muon_batches.h"

#if SPARSETRON_WITH_CUDA
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/ops/optim/muon_batch.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(MuonCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: CUDA Muon tests run on the GPU machine";
}
#else

namespace {

struct HostParam {
    int64_t rows, cols;
    int32_t group;
    MuonSplit split;
    std::vector<float> grad, mom, master;
};

// The split optim/muon.h gives a q_b_proj of `heads` heads of (first, second) rows [heads x
// (first + second), 40]: per head, or per projection across heads.
MuonSplit per_head(int64_t heads, int64_t first, int64_t second, bool per_projection) {
    ModelConfig m;
    m.num_attention_heads = heads, m.qk_head_dim = first, m.qk_pos_emb_head_dim = second;
    RunConfig r;
    r.muon_split_qkv = true;
    r.muon_split_qkv_per_head = !per_projection;
    ParamInfo p;
    p.name = "model.layers.0.self_attn.q_b_proj.weight";
    p.shape = {heads * (first + second), 40};
    return muon_split_for(p, m, r);
}

// An IEEE half's bits as a number (normals, subnormals; the values here are finite).
double half_bits_to_double(uint16_t h) {
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}

// The quintic coefficients of `steps` iterations, as the device batches take them.
std::vector<std::array<float, 3>> quintic_coefficients(int64_t steps) {
    std::vector<std::array<float, 3>> coeff;
    for (int64_t k = 0; k < steps; ++k) {
        const auto c = muon_ns_coefficients("quintic", k);
        coeff.push_back({float(c.a), float(c.b), float(c.c)});
    }
    return coeff;
}

// w[p] = scale x[p] / ||x[p]|| in `elem` for the device matrices x [count, rows, cols], the way the
// optimizer normalizes: x gathered as each problem's momentum (no Nesterov term, no update) with
// the per-tile sums of squares, then muon_normalize_gathered.
void gathered_normalize(cuda::CudaSession& session, const float* x, int64_t count, int64_t rows,
                        int64_t cols, DType elem, void* w, float scale) {
    const ExecContext& ctx = session.ctx();
    const int64_t n = rows * cols;
    std::vector<cuda::MuonDeviceProblem> table;
    for (int64_t p = 0; p < count; ++p)
        table.push_back({nullptr, const_cast<float*>(x) + p * n, nullptr, nullptr, 0, rows, rows, 0,
                         0, nullptr});
    DeviceArray<int64_t> dtable(int64_t(table.size() * sizeof(table[0]) / 8));
    copy_to_device(dtable.get(), table.data(), table.size() * sizeof(table[0]));
    DeviceArray<float> stack(count * n), ws(cuda::muon_gathered_norm_floats(count, rows, cols));
    const auto* dt = reinterpret_cast<const cuda::MuonDeviceProblem*>(dtable.get());
    cuda::muon_gather_batch(ctx, dt, count, rows, cols, false, 0.f, false, nullptr, stack, nullptr,
                            ws);
    cuda::muon_normalize_gathered(ctx, stack, count, rows, cols, 0.f, ws, elem, w, scale);
    session.synchronize();  // the table and the stack go when this returns
}

// `steps` Newton-Schulz iterations of the normalized batch x [count, rr, cc] on the device in
// `elem`, by the Gram form (restarts as given) or the standard one, read back as floats.
std::vector<float> device_newton_schulz(cuda::CudaSession& session, const std::vector<float>& x,
                                        int64_t count, int64_t rr, int64_t cc, DType elem,
                                        bool gram, const std::vector<int64_t>& restarts,
                                        int64_t steps = 5) {
    const ExecContext& ctx = session.ctx();
    const auto coeff = quintic_coefficients(steps);
    const int64_t n = rr * cc, es = int64_t(dtype_size(elem));
    DeviceArray<uint8_t> w(count * n * es), y(count * n * es),
        sq(cuda::kGramSquares * count * rr * rr * es);
    DeviceArray<float> xf(x);
    // x is normalized already: this converts it to elem (times the Gram form's scale).
    const float x_scale = gram ? cuda::gram_ns_x_scale(rr, cc) : 1.f;
    gathered_normalize(session, xf, count, rr, cc, elem, w.get(), x_scale);
    if (gram)
        cuda::newton_schulz_gram_batch(ctx, w.get(), y.get(), sq.get(), count, rr, cc, coeff,
                                       restarts, elem, false, x_scale);
    else
        cuda::newton_schulz_batch(ctx, w.get(), y.get(), sq.get(), sq.get() + count * rr * rr * es,
                                  count, rr, cc, coeff, elem, false);
    session.synchronize();
    std::vector<float> got(size_t(count * n));
    if (elem == DType::F32) {
        copy_to_host(got.data(), w.get(), got.size() * 4);
    } else {
        std::vector<uint16_t> h(got.size());
        copy_to_host(h.data(), w.get(), h.size() * 2);
        for (size_t i = 0; i < h.size(); ++i)
            got[i] =
                elem == DType::BF16 ? bf16_to_float(bf16{h[i]}) : float(half_bits_to_double(h[i]));
    }
    return got;
}

// [count, rr, cc] of Gaussian rows scaled by 50^(-i / rr) (a spectrum spanning ~50x: random
// matrices are well conditioned, and small singular values are where reduced precision fails),
// each normalized to unit Frobenius norm.
std::vector<double> spread_batch(int64_t count, int64_t rr, int64_t cc, uint64_t seed) {
    const int64_t n = rr * cc;
    std::vector<double> x(size_t(count * n));
    for (int64_t p = 0; p < count; ++p) {
        auto raw = random_vector<double>(size_t(n), seed + uint64_t(p));
        double norm = 0;
        for (int64_t i = 0; i < rr; ++i)
            for (int64_t j = 0; j < cc; ++j) {
                double& v = raw[size_t(i * cc + j)];
                v *= std::pow(50.0, -double(i) / double(rr));
                norm += v * v;
            }
        for (int64_t i = 0; i < n; ++i) x[size_t(p * n + i)] = raw[size_t(i)] / std::sqrt(norm);
    }
    return x;
}

template <typename R>
double relative_error(const std::vector<float>& got, const std::vector<R>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i)
        num += (got[i] - double(ref[i])) * (got[i] - double(ref[i])),
            den += double(ref[i]) * double(ref[i]);
    return std::sqrt(num / den);
}

MuonSplit whole(int64_t rows) {
    MuonSplit s;
    s.slices.push_back({{{0, rows}}});
    return s;
}

// Normalized Frobenius error of the applied update against fp64 Newton-Schulz, over every
// slice of every parameter; `skipped` must leave its group's parameters unchanged. With
// `fused_momentum` the gather updates the momentum itself (M = beta M + (1 - beta) G scale,
// checked, and left alone in the skipped group); otherwise the given momentum is the updated one.
// The norms' partial sums come from the gather. With `gram` every batch runs the Gram form
// (newton_schulz_gram_batch, the default restart).
double run_case(const ExecContext& ctx, cuda::CudaSession& session, DType elem, bool tf32,
                int32_t skipped_group, bool fused_momentum = false, bool gram = false) {
    const float beta = 0.9f, step = 0.5f;
    const std::vector<float> scales{0.7f, 1.3f};
    std::vector<HostParam> ps{
        {30, 40, 0, per_head(3, 6, 4, false), {}, {}, {}},
        {30, 40, 0, per_head(3, 6, 4, true), {}, {}, {}},
        {48, 20, 1, whole(48), {}, {}, {}},
        {48, 20, 0, whole(48), {}, {}, {}},
        {30, 40, 1, per_head(3, 6, 4, false), {}, {}, {}},
    };
    // The apply decays the masters of the parameters that decay (0, 2, 4) by 1 - lr wd and
    // rewrites each parameter's bf16 copy (a sentinel before, so an untouched copy shows).
    const float lr = 0.8f, wd = 0.3f;
    auto decays = [](size_t i) { return i % 2 == 0; };
    const bf16 sentinel = float_to_bf16(7.f);
    std::vector<std::unique_ptr<DeviceArray<float>>> g, m, w;
    std::vector<std::unique_ptr<DeviceArray<bf16>>> wb;
    std::vector<MuonSplit> splits;
    std::vector<std::vector<int64_t>> shapes;
    for (size_t i = 0; i < ps.size(); ++i) {
        auto& p = ps[i];
        const size_t n = size_t(p.rows * p.cols);
        p.grad = random_vector<float>(n, 100 + i), p.mom = random_vector<float>(n, 200 + i);
        p.master = random_vector<float>(n, 300 + i);
        g.push_back(std::make_unique<DeviceArray<float>>(p.grad));
        m.push_back(std::make_unique<DeviceArray<float>>(p.mom));
        w.push_back(std::make_unique<DeviceArray<float>>(p.master));
        wb.push_back(std::make_unique<DeviceArray<bf16>>(std::vector<bf16>(n, sentinel)));
        splits.push_back(p.split);
        shapes.push_back({p.rows, p.cols});
    }
    // A small bound: the six [6, 40] head slices split over two batches (one mixing the two
    // clipping groups), the [4, 40] ones share one, the tall matrices go alone.
    const auto batches = plan_muon_batches(splits, shapes, 1000);
    std::vector<cuda::MuonDeviceProblem> table;
    int64_t stack = 0, squares = 0, norms = 0;
    for (const MuonBatch& b : batches) {
        for (const MuonProblem& q : b.problems)
            table.push_back({g[q.param]->get(), m[q.param]->get(), w[q.param]->get(),
                             wb[q.param]->get(), q.row0, q.seg_rows, q.seg_stride,
                             ps[q.param].group, decays(size_t(q.param)) ? 1 : 0, nullptr});
        stack = std::max(stack, b.elements());
        squares = std::max(squares, b.count() * b.rr() * b.rr());
        norms = std::max(norms, cuda::muon_gathered_norm_floats(b.count(), b.rows, b.cols));
    }
    EXPECT_EQ(batches.size(), 7u);
    DeviceArray<int64_t> dtable(int64_t(table.size() * sizeof(table[0]) / 8));
    copy_to_device(dtable.get(), table.data(), table.size() * sizeof(table[0]));
    DeviceArray<float> dstack(stack), dnorms(norms), dscales(scales), dlr(std::vector<float>{lr});
    DeviceArray<int32_t> dskips(std::vector<int32_t>{skipped_group == 0, skipped_group == 1});
    DeviceArray<uint8_t> ws((2 * stack + cuda::kGramSquares * squares) * int64_t(dtype_size(elem)));
    const auto coeff = quintic_coefficients(5);
    const auto* dt = reinterpret_cast<const cuda::MuonDeviceProblem*>(dtable.get());
    const size_t es = dtype_size(elem);
    for (const MuonBatch& b : batches) {
        uint8_t* W = ws.get();
        uint8_t* Y = W + b.elements() * es;
        uint8_t* A = Y + b.elements() * es;
        uint8_t* B = A + b.count() * b.rr() * b.rr() * es;
        cuda::muon_gather_batch(ctx, dt, b.count(), b.rows, b.cols, b.transposed(), beta, true,
                                dscales, dstack, fused_momentum ? dskips.get() : nullptr, dnorms);
        const float x_scale = gram ? cuda::gram_ns_x_scale(b.rr(), b.cc()) : 1.f;
        cuda::muon_normalize_gathered(ctx, dstack, b.count(), b.rows, b.cols, 1e-7f, dnorms, elem,
                                      W, x_scale);
        if (gram)
            cuda::newton_schulz_gram_batch(ctx, W, Y, A, b.count(), b.rr(), b.cc(), coeff,
                                           gram_ns_restarts(), elem, tf32, x_scale);
        else
            cuda::newton_schulz_batch(ctx, W, Y, A, B, b.count(), b.rr(), b.cc(), coeff, elem,
                                      tf32);
        cuda::muon_apply_batch(ctx, dt, b.count(), b.rows, b.cols, b.transposed(), W, elem, step,
                               dskips, dlr, wd);
        dt += b.count();
    }
    session.synchronize();
    double num = 0, den = 0;
    std::vector<double> u, ws64;
    for (size_t i = 0; i < ps.size(); ++i) {
        const auto& p = ps[i];
        const auto got = w[i]->download();
        const auto copy = wb[i]->download();
        const auto mom = m[i]->download();
        // The momentum the update used: updated here (fused) or given as updated.
        std::vector<double> used(mom.size());
        for (size_t k = 0; k < used.size(); ++k)
            used[k] = fused_momentum
                          ? beta * double(p.mom[k]) + (1.0 - beta) * p.grad[k] * scales[p.group]
                          : p.mom[k];
        if (fused_momentum && p.group != skipped_group) {
            double e = 0, n = 0;
            for (size_t k = 0; k < used.size(); ++k)
                e += (mom[k] - used[k]) * (mom[k] - used[k]), n += used[k] * used[k];
            EXPECT_LT(std::sqrt(e / n), 1e-6) << "param " << i << ": momentum not updated";
        } else {
            EXPECT_EQ(mom, p.mom) << "param " << i << ": momentum changed";
        }
        EXPECT_TRUE(w[i]->guard_intact()) << "param " << i;
        if (p.group == skipped_group) {
            EXPECT_EQ(got, p.master) << "param " << i << " of the skipped group changed";
            EXPECT_EQ(std::count_if(copy.begin(), copy.end(),
                                    [&](bf16 x) { return x.bits != sentinel.bits; }),
                      0)
                << "param " << i << " of the skipped group: bf16 copy written";
            continue;
        }
        int64_t wrong = 0;
        for (size_t k = 0; k < got.size(); ++k) wrong += copy[k].bits != float_to_bf16(got[k]).bits;
        EXPECT_EQ(wrong, 0) << "param " << i << ": bf16 copy differs from the rounded master";
        const double decay = decays(i) ? 1.0 - double(lr) * wd : 1.0;
        for (const MuonSlice& s : p.split.slices) {
            const int64_t rows = s.num_rows();
            u.assign(size_t(rows * p.cols), 0.0);
            int64_t at = 0;
            for (auto [b, e] : s.rows)
                for (int64_t r = b; r < e; ++r, ++at)
                    for (int64_t c = 0; c < p.cols; ++c) {
                        const size_t k = size_t(r * p.cols + c);
                        u[size_t(at * p.cols + c)] =
                            (1.0 - beta) * p.grad[k] * scales[p.group] + beta * used[k];
                    }
            newton_schulz<double>(u.data(), rows, p.cols, 5, "quintic", ws64);
            at = 0;
            for (auto [b, e] : s.rows)
                for (int64_t r = b; r < e; ++r, ++at)
                    for (int64_t c = 0; c < p.cols; ++c) {
                        const size_t k = size_t(r * p.cols + c);
                        const double o = u[size_t(at * p.cols + c)];
                        const double d = (decay * p.master[k] - got[k]) / (double(lr) * step);
                        num += (d - o) * (d - o), den += o * o;
                    }
        }
    }
    return std::sqrt(num / den);
}

}  // namespace

// The normalization alone: w[p] = scale x[p] / ||x[p]|| for each matrix of a batch, in fp32 and
// fp16, with n % 4 == 0 (16-byte loads) and n = 1001 (the scalar loop; partial 32 x 32 tiles of
// the gather's sums), against the CPU.
TEST(MuonCuda, GatheredNormalizationMatchesCpu) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const int64_t count = 3;
    const float scale = 64.f;
    for (const auto& [rows, cols] :
         {std::pair{int64_t(64), int64_t(64)}, {int64_t(7), int64_t(143)}}) {
        const int64_t n = rows * cols;
        const auto x = random_vector<float>(size_t(count * n), 40 + uint64_t(n));
        std::vector<double> want(x.size());
        for (int64_t p = 0; p < count; ++p) {
            double ss = 0;
            for (int64_t i = 0; i < n; ++i)
                ss += double(x[size_t(p * n + i)]) * x[size_t(p * n + i)];
            for (int64_t i = 0; i < n; ++i)
                want[size_t(p * n + i)] = scale * x[size_t(p * n + i)] / std::sqrt(ss);
        }
        for (const DType elem : {DType::F32, DType::F16}) {
            SCOPED_TRACE(cat(rows, " x ", cols, ", ", dtype_name(elem)));
            const int64_t es = int64_t(dtype_size(elem));
            DeviceArray<float> xf(x);
            DeviceArray<uint8_t> w(count * n * es);
            gathered_normalize(session, xf, count, rows, cols, elem, w.get(), scale);
            std::vector<uint8_t> h(size_t(count * n * es));
            copy_to_host(h.data(), w.get(), h.size());
            double worst = 0;
            for (size_t i = 0; i < want.size(); ++i) {
                float got;
                if (elem == DType::F32) {
                    std::memcpy(&got, h.data() + 4 * i, 4);
                } else {
                    uint16_t b;
                    std::memcpy(&b, h.data() + 2 * i, 2);
                    got = float(half_bits_to_double(b));
                }
                worst = std::max(worst, std::abs(got - want[i]) / (std::abs(want[i]) + 1e-3));
            }
            EXPECT_LT(worst, elem == DType::F32 ? 1e-5 : 1e-3);
        }
    }
}

// The gather's Nesterov term and its per-tile sums of squares on shapes with partial 32 x 32 tiles
// in both orientations (a tall [70, 45] batch gathered transposed, a wide [45, 70] one as is):
// the normalized stack against the CPU's u / ||u|| in the gathered layout.
TEST(MuonCuda, GatheredNormsMatchCpuInBothOrientations) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    const float beta = 0.9f, gscale = 0.7f;
    for (const auto& [rows, cols, transposed] : {std::tuple{int64_t(70), int64_t(45), true},
                                                 std::tuple{int64_t(45), int64_t(70), false}}) {
        SCOPED_TRACE(cat(rows, " x ", cols, transposed ? ", transposed" : ""));
        const int64_t count = 3, n = rows * cols;
        // The gather reads the gradient and the momentum only (no master, no bf16 copy).
        std::vector<std::vector<float>> hg, hm;
        std::vector<std::unique_ptr<DeviceArray<float>>> g, m;
        std::vector<cuda::MuonDeviceProblem> table;
        for (int64_t p = 0; p < count; ++p) {
            hg.push_back(random_vector<float>(size_t(n), 60 + uint64_t(p)));
            hm.push_back(random_vector<float>(size_t(n), 70 + uint64_t(p)));
            g.push_back(std::make_unique<DeviceArray<float>>(hg.back()));
            m.push_back(std::make_unique<DeviceArray<float>>(hm.back()));
            table.push_back(
                {g.back()->get(), m.back()->get(), nullptr, nullptr, 0, rows, rows, 0, 0, nullptr});
        }
        DeviceArray<int64_t> dtable(int64_t(table.size() * sizeof(table[0]) / 8));
        copy_to_device(dtable.get(), table.data(), table.size() * sizeof(table[0]));
        const auto* dt = reinterpret_cast<const cuda::MuonDeviceProblem*>(dtable.get());
        DeviceArray<float> scales(std::vector<float>{gscale}), stack(count * n);
        DeviceArray<float> ws(cuda::muon_gathered_norm_floats(count, rows, cols));
        DeviceArray<float> out(count * n);
        cuda::muon_gather_batch(ctx, dt, count, rows, cols, transposed, beta, true, scales, stack,
                                nullptr, ws);
        cuda::muon_normalize_gathered(ctx, stack, count, rows, cols, 1e-7f, ws, DType::F32,
                                      out.get(), 2.f);
        session.synchronize();
        std::vector<double> want(size_t(count * n));
        for (int64_t p = 0; p < count; ++p) {
            double ss = 0;
            std::vector<double> u(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) {
                u[size_t(i)] = (1.0 - beta) * hg[size_t(p)][size_t(i)] * gscale +
                               beta * hm[size_t(p)][size_t(i)];
                ss += u[size_t(i)] * u[size_t(i)];
            }
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t c = 0; c < cols; ++c) {
                    const int64_t at = transposed ? c * rows + r : r * cols + c;
                    want[size_t(p * n + at)] = 2.0 * u[size_t(r * cols + c)] / std::sqrt(ss);
                }
        }
        EXPECT_LT(relative_error(out.download(), want), 1e-6);
        EXPECT_TRUE(ws.guard_intact() && out.guard_intact());
    }
}

TEST(MuonCuda, BatchedNewtonSchulzMatchesCpuInEachPrecision) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    const double fp32 = run_case(ctx, session, DType::F32, false, -1);
    const double tf32 = run_case(ctx, session, DType::F32, true, 1);
    const double bf16 = run_case(ctx, session, DType::BF16, false, 0);
    const double fused = run_case(ctx, session, DType::F32, false, 1, true);
    // The Gram form through the same gather / normalize / apply: fp32 and the fp16 products the
    // optimizer uses under bf16 matmul precision.
    const double gram32 = run_case(ctx, session, DType::F32, false, 0, false, true);
    const double gram16 = run_case(ctx, session, DType::F16, false, 1, true, true);
    std::cout << "[harness] batched Newton-Schulz update vs fp64 CPU, normalized error: fp32 "
              << fp32 << ", tf32 " << tf32 << ", bf16 " << bf16
              << ", fp32 with the momentum updated in the gather " << fused << ", Gram form fp32 "
              << gram32 << ", Gram form fp16 " << gram16 << "\n";
    EXPECT_LT(fp32, 1e-4);
    EXPECT_LT(fused, 1e-4);
    EXPECT_LT(gram32, 2e-5);
    EXPECT_GT(gram16, 5e-5);  // fp16 products, not fp32 ones
    EXPECT_LT(gram16, bf16);
    EXPECT_GT(tf32, 5e-6);
    EXPECT_LT(tf32, 1e-2);
    EXPECT_GT(bf16, 5e-4);
    EXPECT_GT(bf16, tf32);
    EXPECT_LT(bf16, 8e-2);
}

// Newton-Schulz on Gram sizes large enough for the blocked symmetric products (rr >= 512: two
// half-size diagonal blocks, the lower-left block, its transposed copy), batched, against fp64 NS
// on the CPU. A wrong block or mirror gives O(1) errors; fp32 must stay fp32-sized. 5 and 4
// iterations: the iterate alternates between two buffers and must end in w either way.
TEST(MuonCuda, SymmetricBlockedNewtonSchulzMatchesCpu) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    for (const int64_t steps : {int64_t(5), int64_t(4)}) {
        SCOPED_TRACE(cat(steps, " iterations"));
        const int64_t count = 2, rr = 512, cc = 576, n = rr * cc;
        std::vector<double> ref(size_t(count * n)), ws;
        std::vector<float> x(size_t(count * n));
        for (int64_t p = 0; p < count; ++p) {
            const auto raw = random_vector<double>(size_t(n), 900 + uint64_t(p));
            double norm = 0;
            for (double v : raw) norm += v * v;
            norm = std::sqrt(norm);
            for (int64_t i = 0; i < n; ++i) x[size_t(p * n + i)] = float(raw[size_t(i)] / norm);
            std::copy(raw.begin(), raw.end(), ref.begin() + p * n);
            newton_schulz<double>(ref.data() + p * n, rr, cc, steps, "quintic", ws);
        }
        auto error = [&](DType elem) {
            return relative_error(
                device_newton_schulz(session, x, count, rr, cc, elem, false, {}, steps), ref);
        };
        const double fp32 = error(DType::F32), bf16e = error(DType::BF16);
        std::cout << "[harness] blocked symmetric Newton-Schulz [2 x 512 x 576], " << steps
                  << " iterations, vs fp64 CPU: fp32 " << fp32 << ", bf16 " << bf16e << "\n";
        EXPECT_LT(fp32, 1e-4);
        EXPECT_LT(bf16e, 5e-2);
    }
}

// The Gram form against fp64 standard Newton-Schulz on the CPU (equal in exact arithmetic), on
// batches with the blocked symmetric products (rr >= 512) and one with full ones (rr = 96). Restart
// sets {3} (the default), {2} and {} (the iterate ends in w after two Q X products or is copied
// back after one).
// fp32 must be fp32-sized; fp16 must beat the standard form in bf16, the mode it replaces (the CPU
// emulation measured 3-5x).
TEST(MuonCuda, GramNewtonSchulzMatchesCpu) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    struct Shape {
        int64_t count, rr, cc;
    };
    // rr = 528 and 584: the mirror's 16-byte form with a partial 64-wide tile (m = 264) and its
    // scalar form (m = 292, not a multiple of 8) in fp16.
    for (const Shape sh :
         {Shape{2, 512, 1536}, Shape{3, 96, 384}, Shape{1, 528, 1024}, Shape{1, 584, 1024}}) {
        const int64_t count = sh.count, rr = sh.rr, cc = sh.cc, n = rr * cc;
        std::vector<double> ref = spread_batch(count, rr, cc, 700), ws;
        const std::vector<float> x(ref.begin(), ref.end());
        for (int64_t p = 0; p < count; ++p)
            newton_schulz<double>(ref.data() + p * n, rr, cc, 5, "quintic", ws);
        auto error = [&](DType elem, bool gram, const std::vector<int64_t>& restarts) {
            return relative_error(
                device_newton_schulz(session, x, count, rr, cc, elem, gram, restarts), ref);
        };
        const double gram32 = error(DType::F32, true, gram_ns_restarts());
        const double gram32_no_restart = error(DType::F32, true, {});
        const double gram16 = error(DType::F16, true, gram_ns_restarts());
        // A restart at iteration 2 (the default restart at 3 is more accurate; docs/optimizer.md),
        // same FLOPs.
        const double gram16_at2 = error(DType::F16, true, {2});
        const double standard_bf16 = error(DType::BF16, false, {});
        const double standard_fp16 = error(DType::F16, false, {});
        std::cout << "[harness] Gram Newton-Schulz [" << count << " x " << rr << " x " << cc
                  << "] vs fp64 CPU: fp32 " << gram32 << " (no restart " << gram32_no_restart
                  << "), fp16 " << gram16 << " (restarting at 2: " << gram16_at2
                  << "); standard form bf16 " << standard_bf16 << ", fp16 " << standard_fp16
                  << "\n";
        EXPECT_LT(gram16, gram16_at2);
        // Products with Z^T instead of Z (the operands are symmetric only up to rounding) gave
        // 5e-5 to 8e-5 here.
        EXPECT_LT(gram32, 2e-5);
        EXPECT_LT(gram32_no_restart, 1e-4);
        EXPECT_LT(gram16, standard_bf16);
        EXPECT_LT(gram16, 3e-2);
        EXPECT_GT(gram16, 1e-5);  // really fp16
    }
}

// A large matrix, [4096, 16384] (the proxy's largest is [6144, 24576]): unscaled, its normalized
// entries (rms 1.2e-4) and R's entries (diagonal ~2.4e-4, off-diagonal ~2e-6) would sit at or
// below fp16's smallest normal, 6.1e-5. The reference is the standard form in fp32 on the device
// (6e-7 from fp64 on the small batches above).
TEST(MuonCuda, GramNewtonSchulzLargeMatrixInFp16) {
    REQUIRE_GPU();
    cuda::CudaSession session;
    const int64_t rr = 4096, cc = 16384;
    const auto x64 = spread_batch(1, rr, cc, 800);
    const std::vector<float> x(x64.begin(), x64.end());
    const auto ref = device_newton_schulz(session, x, 1, rr, cc, DType::F32, false, {});
    const double gram16 = relative_error(
        device_newton_schulz(session, x, 1, rr, cc, DType::F16, true, gram_ns_restarts()), ref);
    const double standard_bf16 =
        relative_error(device_newton_schulz(session, x, 1, rr, cc, DType::BF16, false, {}), ref);
    std::cout << "[harness] Gram Newton-Schulz [" << rr << " x " << cc
              << "] vs the fp32 standard form: fp16 " << gram16 << "; standard form bf16 "
              << standard_bf16 << "\n";
    EXPECT_LT(gram16, standard_bf16);
    EXPECT_GT(gram16, 1e-5);
}

#endif
