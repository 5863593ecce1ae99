// The MoE family on CUDA against the CPU reference: routing, permutation, gather and combine
// and their backwards, the sequence aux loss, the grouped expert GEMM in every form, the paged
// stash.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "gpu/harness.h"
#include "sparsetron/cuda/device_caps.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/moe/grouped_gemm_forms.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/ops/moe/paged_stash.h"
#include "sparsetron/ops/moe/sequence_aux.h"

#if SPARSETRON_WITH_CUDA
#include "ops/op_fixtures.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(MoeCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

// The moe family's CUDA tests: the shared op fixture (op_fixtures.h).
class MoeCuda : public CudaOps {};

TEST_F(MoeCuda, RouterPermuteGatherCombine) {
    const Docs docs;
    const int64_t T = 200, E = 12, k = 3, capacity = 40;
    auto logits = random_vector<float>(T * E, 101, 3.0), bias = random_vector<float>(E, 102, 0.2);
    auto rbv = docs.row_begin(T);
    DeviceArray<float> dl(logits), db(bias), probs(T * E), gates(T * k);
    DeviceArray<int32_t> rb(rbv), topk(T * k), counts(E), offsets(E + 1), slot(T * k), perm(T * k);
    for (bool force : {false, true}) {
        cuda::router_topk(ctx(), dl, db, rb, T, E, k, force, 2.5f, probs, topk, gates);
        cuda::moe_permute(ctx(), topk, T, E, k, capacity, counts, offsets, slot, perm);
        sync();
        // Reference routing (moe.cpp's rule) on the same fp32 logits.
        auto pg = probs.download(), gg = gates.download();
        auto tg = topk.download();
        std::vector<float> pref(T * E), gref(T * k, 0.f);
        std::vector<int32_t> tref(T * k, -1);
        for (int64_t i = 0; i < T * E; ++i)
            pref[i] = float(1.0 / (1.0 + std::exp(-double(logits[i]))));
        for (int64_t t = 0; t < T; ++t) {
            if (rbv[t] < 0) continue;
            std::vector<int32_t> order(E);
            std::iota(order.begin(), order.end(), 0);
            const float* p = pg.data() + t * E;  // the GPU's probabilities: no tie flips
            std::partial_sort(order.begin(), order.begin() + k, order.end(),
                              [&](int32_t x, int32_t y) {
                                  float vx = p[x] + bias[x], vy = p[y] + bias[y];
                                  return vx > vy || (vx == vy && x < y);
                              });
            for (int64_t j = 0; j < k; ++j)
                tref[t * k + j] = force ? int32_t((t * k + j) % E) : order[j];
            double sum = 1e-20;
            for (int64_t j = 0; j < k; ++j) sum += p[tref[t * k + j]];
            for (int64_t j = 0; j < k; ++j) gref[t * k + j] = float(p[tref[t * k + j]] / sum * 2.5);
        }
        expect_close(cat("router probs force=", force), pg, pref, 1e-6);
        EXPECT_EQ(tg, tref) << "router top-k, force=" << force;
        expect_close(cat("router gates force=", force), gg, gref, 1e-6);
        // Permutation: expert-major, token order within an expert, capacity drops the rest.
        std::vector<int32_t> cref(E, 0), oref(E + 1, 0), sref(T * k, -1), permref;
        for (int64_t i = 0; i < T * k; ++i)
            if (tref[i] >= 0) ++cref[tref[i]];
        for (int64_t e = 0; e < E; ++e)
            oref[e + 1] = oref[e] + std::min<int32_t>(cref[e], capacity);
        permref.assign(oref[E], -1);
        std::vector<int32_t> fill(oref.begin(), oref.end() - 1);
        for (int64_t i = 0; i < T * k; ++i) {
            const int32_t e = tref[i];
            if (e >= 0 && fill[e] < oref[e + 1])
                sref[i] = fill[e], permref[fill[e]++] = int32_t(i / k);
        }
        EXPECT_EQ(counts.download(), cref);
        EXPECT_EQ(offsets.download(), oref);
        EXPECT_EQ(slot.download(), sref);
        auto pgm = perm.download();
        EXPECT_TRUE(std::equal(permref.begin(), permref.end(), pgm.begin()));
        if (!force) {
            EXPECT_GT(oref[E], 0);
        }
        // Gather and combine: rows of 40 (the 16-byte vector kernels) and of 36 (the scalar ones).
        for (const int64_t gdim : {int64_t(40), int64_t(36)}) {
            SCOPED_TRACE(cat("dim ", gdim));
            Rounded x(T * gdim, 103), outp(T * k * gdim, 104), y0(T * gdim, 105);
            DeviceArray<bf16> xp(T * k * gdim);
            cuda::moe_gather(ctx(), x.dev, perm, offsets, E, T * k, gdim, xp);
            cuda::moe_combine(ctx(), outp.dev, slot, gates, T, k, gdim, y0.dev);
            sync();
            auto xpg = download_f(xp);
            std::vector<float> xpr(oref[E] * gdim);
            for (int32_t r = 0; r < oref[E]; ++r)
                std::copy_n(x.host.begin() + permref[r] * gdim, gdim, xpr.begin() + r * gdim);
            xpg.resize(oref[E] * gdim);
            expect_close("moe gather", xpg, xpr, 1e-7);
            std::vector<float> yr = y0.host;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < k; ++j)
                    if (sref[t * k + j] >= 0)
                        for (int64_t c = 0; c < gdim; ++c)
                            yr[t * gdim + c] +=
                                gg[t * k + j] * outp.host[sref[t * k + j] * gdim + c];
            expect_close("moe combine", download_f(y0.dev), yr, kBf16Tol);
        }
    }
}

namespace {
// A grouped GEMM's row operand: `rows` random rows of `width`, then `pad` rows of NaN. The buffer's
// capacity is rows + pad; the kernels' tile loads read past an expert's last row, and nothing
// they read past offsets[E] may reach an output (the weight gradient's reduction included).
Rounded nan_padded_rows(int64_t rows, int64_t pad, int64_t width, uint64_t seed) {
    std::vector<float> v = random_vector<float>(rows * width, seed);
    v.resize((rows + pad) * width, std::numeric_limits<float>::quiet_NaN());
    return Rounded(std::move(v));
}
constexpr int64_t kNanPad = 72;  // more than a 64-row slice, not a multiple of it

// Each kind against per-expert CPU GEMMs. Uneven experts (one empty), rows of some expert up to the
// bound; RowsTimesWeightT runs twice, the second time accumulating into its own output. The weight
// gradient is written over NaN (nothing may read the old gradient; the empty expert gets zeros),
// then added to: twice the product.
void grouped_gemm_check(const cuda::CudaSession& session, const std::vector<int32_t>& off,
                        int64_t n, int64_t kk, int64_t max_rows, const std::string& tag) {
    const ExecContext& ctx = session.ctx();
    const int64_t E = int64_t(off.size()) - 1, R = off.back(), cap = R + kNanPad;
    DeviceArray<int32_t> doff(off);
    Rounded w(E * n * kk, 111, 0.3);
    Rounded x = nan_padded_rows(R, kNanPad, kk, 112), dy = nan_padded_rows(R, kNanPad, n, 113);
    DeviceArray<bf16> y(R * n), dx(R * kk);
    DeviceArray<float> dw(std::vector<float>(E * n * kk, std::numeric_limits<float>::quiet_NaN()));
    using K2 = cuda::GroupedGemm;
    auto args = [&](K2 kind, const bf16* a, const bf16* b, void* c, bool acc) {
        return cuda::GroupedGemmArgs{kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc};
    };
    cuda::grouped_gemm(ctx, args(K2::RowsTimesWeightT, x.dev, w.dev, y, false));
    cuda::grouped_gemm(ctx, args(K2::RowsTimesWeightT, x.dev, w.dev, y, /*acc=*/true));
    cuda::grouped_gemm(ctx, args(K2::RowsTimesWeight, dy.dev, w.dev, dx, false));
    cuda::grouped_gemm(ctx, args(K2::WeightGrad, dy.dev, x.dev, dw, false));
    session.synchronize();
    const std::vector<float> dw_written = dw.download();
    cuda::grouped_gemm(ctx, args(K2::WeightGrad, dy.dev, x.dev, dw, /*acc=*/true));
    session.synchronize();
    std::vector<float> yr(R * n), dxr(R * kk), dwr(E * n * kk, 0.f);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = off[e], m = off[e + 1] - off[e];
        if (m == 0) continue;
        const float* we = w.host.data() + e * n * kk;
        cpu::gemm<float>(false, true, m, n, kk, 2.f, x.host.data() + r0 * kk, kk, we, kk, 0.f,
                         yr.data() + r0 * n, n);
        cpu::gemm<float>(false, false, m, kk, n, 1.f, dy.host.data() + r0 * n, n, we, kk, 0.f,
                         dxr.data() + r0 * kk, kk);
        cpu::gemm<float>(true, false, n, kk, m, 1.f, dy.host.data() + r0 * n, n,
                         x.host.data() + r0 * kk, kk, 0.f, dwr.data() + e * n * kk, kk);
    }
    expect_close(tag + " x W^T (twice, accumulated)", download_f(y), yr, kBf16Tol);
    expect_close(tag + " dy W", download_f(dx), dxr, kBf16Tol);
    expect_close(tag + " weight grad (fp32 =, over NaN)", dw_written, dwr, 1e-5);
    std::vector<float> dwr2 = dwr;
    for (float& v : dwr2) v *= 2.f;
    expect_close(tag + " weight grad (fp32 +=)", dw.download(), dwr2, 1e-5);
    expect_guard(y, tag + " y");
    expect_guard(dx, tag + " dx");
    expect_guard(dw, tag + " dw");
}
}  // namespace

// Dimensions that are multiples of 8: the pipelined tensor-core kernel, with partial tiles in
// every dimension (96 < 128 columns, 80 = 2.5 reduction slices, odd row counts).
TEST_F(MoeCuda, GroupedGemmAllKinds) {
    grouped_gemm_check(*session_, {0, 37, 37, 101, 130, 200}, 96, 80, 70, "grouped gemm");
}

// Several 128 x 128 tiles per expert and more reduction slices than pipeline stages.
TEST_F(MoeCuda, GroupedGemmManyTiles) {
    grouped_gemm_check(*session_, {0, 300, 301, 301, 560}, 264, 392, 300, "grouped gemm (tiles)");
}

namespace {
// Every form of the grouped GEMM the plan supports for the shape (the dispatch's choice; each of
// supported_grouped_gemm_forms; on sm_90a also the wgmma kernel on four blocks, so every block
// walks many tiles) against per-expert CPU GEMMs, each kind, partial tiles; the weight gradient
// written over NaN (an empty expert: zeros), then added to (twice the product), into an fp32
// gradient and into a bf16 one (bf16 gradient buffers: each result within bf16 rounding).
void grouped_gemm_every_form(const cuda::CudaSession& session, const std::vector<int32_t>& off,
                             int64_t n, int64_t kk) {
    const ExecContext& ctx = session.ctx();
    const int64_t E = int64_t(off.size()) - 1, R = off.back(), cap = R + kNanPad;
    int64_t max_rows = 0;
    for (int64_t e = 0; e < E; ++e) max_rows = std::max<int64_t>(max_rows, off[e + 1] - off[e]);
    DeviceArray<int32_t> doff(off);
    Rounded w(E * n * kk, 121, 0.3);
    Rounded x = nan_padded_rows(R, kNanPad, kk, 122), dy = nan_padded_rows(R, kNanPad, n, 123);
    std::vector<float> yr(R * n), dxr(R * kk), dwr(E * n * kk, 0.f);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = off[e], m = off[e + 1] - off[e];
        if (m == 0) continue;
        const float* we = w.host.data() + e * n * kk;
        cpu::gemm<float>(false, true, m, n, kk, 1.f, x.host.data() + r0 * kk, kk, we, kk, 0.f,
                         yr.data() + r0 * n, n);
        cpu::gemm<float>(false, false, m, kk, n, 1.f, dy.host.data() + r0 * n, n, we, kk, 0.f,
                         dxr.data() + r0 * kk, kk);
        cpu::gemm<float>(true, false, n, kk, m, 1.f, dy.host.data() + r0 * n, n,
                         x.host.data() + r0 * kk, kk, 0.f, dwr.data() + e * n * kk, kk);
    }
    std::vector<float> dwr2 = dwr;
    for (float& v : dwr2) v *= 2.f;
    using K2 = cuda::GroupedGemm;
    using GemmForm = std::function<void(K2, const bf16*, const bf16*, void*, bool, DType)>;
    std::vector<std::pair<std::string, GemmForm>> forms;
    // Every form the plan supports for this shape (grouped_gemm_plan.h), the planned one first.
    const cuda::GroupedGemmShape shape{n, kk, 0, true, cuda::has_sm90a()};
    const cuda::GroupedGemmForm planned = cuda::plan_grouped_gemm(shape);
    EXPECT_EQ(planned,
              cuda::has_sm90a() ? cuda::GroupedGemmForm::Wgmma : cuda::GroupedGemmForm::Wmma);
    forms.emplace_back(
        cat("grouped_gemm (planned: ", cuda::form_name(planned), ")"),
        [&](K2 kind, const bf16* a, const bf16* b, void* c, bool acc, DType t) {
            cuda::grouped_gemm(ctx, {kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc, t});
        });
    for (cuda::GroupedGemmForm f : cuda::supported_grouped_gemm_forms(shape))
        forms.emplace_back(cuda::form_name(f), [&, f](K2 kind, const bf16* a, const bf16* b,
                                                      void* c, bool acc, DType t) {
            cuda::grouped_gemm(ctx, f, {kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc, t});
        });
    if (cuda::has_sm90a())
        forms.emplace_back("Wgmma on 4 blocks", [&](K2 kind, const bf16* a, const bf16* b, void* c,
                                                    bool acc, DType t) {
            cuda::grouped_gemm_wgmma(ctx, {kind, doff, E, max_rows, cap, n, kk, a, b, c, 0, acc, t},
                                     4);
        });
    for (const auto& [name, run] : forms) {
        DeviceArray<bf16> y(R * n), dx(R * kk);
        DeviceArray<float> dw(
            std::vector<float>(E * n * kk, std::numeric_limits<float>::quiet_NaN()));
        const DType F32 = DType::F32, BF = DType::BF16;
        run(K2::RowsTimesWeightT, x.dev, w.dev, static_cast<bf16*>(y), false, F32);
        run(K2::RowsTimesWeight, dy.dev, w.dev, static_cast<bf16*>(dx), false, F32);
        run(K2::WeightGrad, dy.dev, x.dev, static_cast<float*>(dw), false, F32);
        session.synchronize();
        expect_close(name + ": x W^T", download_f(y), yr, kBf16Tol);
        expect_close(name + ": dy W", download_f(dx), dxr, kBf16Tol);
        expect_close(name + ": weight grad (=, over NaN)", dw.download(), dwr, 1e-5);
        run(K2::WeightGrad, dy.dev, x.dev, static_cast<float*>(dw), true, F32);
        session.synchronize();
        expect_close(name + ": weight grad (+=)", dw.download(), dwr2, 1e-5);
        // A bf16 gradient: one rounding of the fp32 sum (=), two with the addition (+=).
        DeviceArray<bf16> dw16(std::vector<bf16>(
            size_t(E * n * kk), float_to_bf16(std::numeric_limits<float>::quiet_NaN())));
        run(K2::WeightGrad, dy.dev, x.dev, static_cast<bf16*>(dw16), false, BF);
        session.synchronize();
        expect_close(name + ": bf16 weight grad (=, over NaN)", download_f(dw16), dwr, 3e-3);
        run(K2::WeightGrad, dy.dev, x.dev, static_cast<bf16*>(dw16), true, BF);
        session.synchronize();
        expect_close(name + ": bf16 weight grad (+=)", download_f(dw16), dwr2, 4e-3);
        expect_guard(dw16, name + " bf16 dw");
    }
}
}  // namespace

TEST_F(MoeCuda, GroupedGemmEveryForm) {
    grouped_gemm_every_form(*session_, {0, 37, 37, 101, 260}, 136, 200);
}

TEST_F(MoeCuda, GroupedGemmEveryFormDeepReduction) {
    grouped_gemm_every_form(*session_, {0, 300, 301, 301, 900}, 264, 1088);
}

// Dimensions not a multiple of 8: the simple fallback kernel.
TEST_F(MoeCuda, GroupedGemmUnalignedFallback) {
    grouped_gemm_check(*session_, {0, 37, 37, 101, 130, 200}, 36, 20, 70,
                       "grouped gemm (unaligned)");
}

namespace {
// The paged stash's kernels against the CPU reference: the same pushes and pops (one overflowing)
// give the same state words, page tables, pool pages and popped rows. `widths` picks the copy
// path (multiples of 8: 16-byte vectors; otherwise element by element).
void paged_stash_check(const cuda::CudaSession& session, std::vector<int64_t> widths) {
    const ExecContext& ctx = session.ctx();
    const int64_t pages = 12, page_rows = 8, max_rows = 40, tbl = 1 + 5;
    int64_t width = 0;
    for (int64_t w : widths) width += w;
    struct Push {
        int32_t rows;
        std::vector<std::vector<float>> host;  // per segment, bf16-exact
        std::vector<std::unique_ptr<DeviceArray<bf16>>> dev;
    };
    const int32_t rows[] = {17, 33, 40, 0};  // 3, 5 and 5 pages: the third overflows; then none
    std::vector<Push> push(4);
    for (int i = 0; i < 4; ++i) {
        push[i].rows = rows[i];
        for (size_t s = 0; s < widths.size(); ++s) {
            push[i].host.push_back(random_vector<float>(max_rows * widths[s], 900 + 10 * i + s));
            push[i].dev.push_back(
                std::make_unique<DeviceArray<bf16>>(to_bf16_rounding(push[i].host.back())));
        }
    }
    auto rows_of = [&](std::vector<std::unique_ptr<DeviceArray<bf16>>>& d) {
        StashRows r;
        r.count = int(widths.size());
        for (size_t s = 0; s < widths.size(); ++s) r.data[s] = d[s]->get(), r.width[s] = widths[s];
        return r;
    };
    // Device side.
    DeviceArray<int32_t> state(kStashStateWords), free_list(pages),
        counts(std::vector<int32_t>(rows, rows + 4));
    DeviceArray<bf16> pool(pages * page_rows * width);
    std::vector<std::unique_ptr<DeviceArray<int32_t>>> tables;
    for (int i = 0; i < 4; ++i) tables.push_back(std::make_unique<DeviceArray<int32_t>>(tbl));
    // Host side.
    std::vector<int32_t> hstate(kStashStateWords), hfree(pages), htables(4 * tbl, -7);
    std::vector<bf16> hpool(pages * page_rows * width);
    cuda::stash_reset(ctx, state, free_list, pages, true);
    cpu::stash_reset(hstate.data(), hfree.data(), pages, true);
    for (int i = 0; i < 4; ++i) {
        cuda::stash_push(ctx, state, free_list, pages, *tables[i], max_rows, counts.get() + i,
                         page_rows, rows_of(push[i].dev), pool);
        std::vector<std::vector<bf16>> segs;
        StashRows h;
        h.count = int(widths.size());
        for (size_t s = 0; s < widths.size(); ++s) segs.push_back(push[i].dev[s]->download());
        for (size_t s = 0; s < widths.size(); ++s)
            h.data[s] = segs[s].data(), h.width[s] = widths[s];
        cpu::stash_push(hstate.data(), hfree.data(), pages, htables.data() + i * tbl, max_rows,
                        &rows[i], page_rows, h, hpool.data());
    }
    session.synchronize();
    EXPECT_EQ(state.download(), hstate);
    EXPECT_EQ(hstate[2], 1) << "the third push should overflow";
    for (int i = 0; i < 4; ++i) {
        auto t = tables[i]->download();
        const int32_t n = htables[i * tbl];
        ASSERT_EQ(t[0], n) << "push " << i;
        for (int32_t j = 0; j < std::max(n, 0); ++j) EXPECT_EQ(t[1 + j], htables[i * tbl + 1 + j]);
    }
    // Every page the pushes hold has the reference's contents.
    auto dpool = pool.download();
    for (int i = 0; i < 4; ++i)
        for (int32_t j = 0; j < std::max(htables[i * tbl], 0); ++j) {
            const int64_t at = int64_t(htables[i * tbl + 1 + j]) * page_rows * width;
            const int64_t used = std::min<int64_t>(page_rows, rows[i] - j * page_rows) * width;
            for (int64_t e = 0; e < used; ++e)
                ASSERT_EQ(dpool[at + e].bits, hpool[at + e].bits) << "push " << i << " page " << j;
        }
    // Pop in reverse into fresh (poisoned) buffers: the rows come back bit for bit.
    for (int i = 3; i >= 0; --i) {
        std::vector<std::unique_ptr<DeviceArray<bf16>>> back;
        for (int64_t w : widths) back.push_back(std::make_unique<DeviceArray<bf16>>(max_rows * w));
        cuda::stash_pop(ctx, state, free_list, *tables[i], max_rows, counts.get() + i, page_rows,
                        rows_of(back), pool);
        std::vector<std::vector<bf16>> hb;
        StashRows h;
        h.count = int(widths.size());
        for (size_t s = 0; s < widths.size(); ++s) hb.emplace_back(max_rows * widths[s]);
        for (size_t s = 0; s < widths.size(); ++s) h.data[s] = hb[s].data(), h.width[s] = widths[s];
        cpu::stash_pop(hstate.data(), hfree.data(), htables.data() + i * tbl, &rows[i], page_rows,
                       h, hpool.data());
        session.synchronize();
        if (htables[i * tbl] < 0) continue;  // the overflowed push has nothing to give back
        for (size_t s = 0; s < widths.size(); ++s) {
            auto got = to_float(back[s]->download());
            got.resize(size_t(rows[i] * widths[s]));
            std::vector<float> want(push[i].host[s].begin(),
                                    push[i].host[s].begin() + rows[i] * widths[s]);
            EXPECT_EQ(got, want) << "push " << i << " segment " << s;
            EXPECT_TRUE(back[s]->guard_intact());
        }
    }
    EXPECT_EQ(state.download(), hstate);
    EXPECT_EQ(free_list.download(), hfree);
    EXPECT_EQ(hstate[0], pages);
    EXPECT_TRUE(pool.guard_intact());
    std::cout << "[harness] paged stash widths " << widths.size() << " segments, " << width
              << " per row: peak pages " << hstate[1] << ", demand " << hstate[3] << " of " << pages
              << "\n";
}
}  // namespace

TEST_F(MoeCuda, PagedStashMatchesTheCpuReference) {
    paged_stash_check(*session_, {16, 8, 24});  // vectorized copies
    paged_stash_check(*session_, {3, 2, 5});    // element by element
}

// Rows of 40 take the 16-byte vector kernels, rows of 36 the scalar ones.
TEST_F(MoeCuda, MoeBackwardPieces) {
    for (const int64_t dim : {int64_t(40), int64_t(36)}) {
        SCOPED_TRACE(cat("dim ", dim));
        const int64_t T = 150, k = 3, E = 6, R = T * k;
        // Routing: every third token unrouted in its last choice (a capacity drop), rows permuted.
        std::vector<int32_t> slot(T * k), topk(T * k);
        for (int64_t i = 0; i < T * k; ++i) {
            slot[i] = (i % k == k - 1 && (i / k) % 3 == 0) ? -1 : int32_t((i * 7) % R);
            topk[i] = int32_t((i * 5 + i / k) % E);
        }
        // Distinct experts per token (the router never picks one twice).
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j) topk[t * k + j] = int32_t((t + j * 2) % E);
        auto gates = random_vector<float>(T * k, 151);
        auto probs = random_vector<float>(T * E, 152);
        for (auto& x : probs) x = 0.5f + 0.45f * x;
        Rounded dy(T * dim, 153), outp(R * dim, 154), dxp(R * dim, 155), dm0(T * dim, 156);
        DeviceArray<int32_t> dslot(slot), dtopk(topk);
        DeviceArray<float> dgates_in(gates), dprobs(probs), dgates(T * k), dlogits(T * E);
        DeviceArray<bf16> doutp(R * dim);
        cuda::moe_combine_backward(ctx(), dy.dev, outp.dev, dslot, dgates_in, T, k, dim, doutp,
                                   dgates);
        cuda::moe_gather_backward(ctx(), dxp.dev, dslot, T, k, dim, dm0.dev, true);
        sync();
        std::vector<float> dop_ref = download_f(doutp), dg_ref(T * k, 0.f), dm_ref = dm0.host;
        std::vector<bool> written(R * dim, false);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j) {
                const int32_t r = slot[t * k + j];
                if (r < 0) continue;
                double s = 0;
                for (int64_t c = 0; c < dim; ++c) {
                    s += double(dy.host[t * dim + c]) * outp.host[r * dim + c];
                    dop_ref[r * dim + c] = gates[t * k + j] * dy.host[t * dim + c];
                    written[r * dim + c] = true;
                    dm_ref[t * dim + c] += dxp.host[r * dim + c];
                }
                dg_ref[t * k + j] = float(s);
            }
        expect_close("moe combine backward dout_perm", download_f(doutp), dop_ref, kBf16Tol,
                     written);
        expect_close("moe combine backward dgates", dgates.download(), dg_ref, 1e-5);
        expect_close("moe gather backward (accumulate)", download_f(dm0.dev), dm_ref, kBf16Tol);
        // The gate gradients without the output rows: du [R, F] (the down projection's input
        // gradient of unscaled rows) against the SwiGLU output, then du and the rows scaled.
        // F = dim + 8 (vector path at dim 40, scalar at 36; the rows' width differs from F).
        const int64_t F = dim + 8;
        Rounded du(R * F, 157), act(R * F, 158), rows(R * dim, 159);
        DeviceArray<float> dgates2(T * k);
        cuda::moe_gate_backward_rows(ctx(), du.dev, act.dev, dslot, dgates_in, T, k, F, dim,
                                     rows.dev, dgates2);
        sync();
        std::vector<float> du_ref = du.host, rows_ref = rows.host, dg2_ref(T * k, 0.f);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j) {
                const int32_t r = slot[t * k + j];
                if (r < 0) continue;
                const float g = gates[t * k + j];
                double s = 0;
                for (int64_t c = 0; c < F; ++c) {
                    s += double(du.host[r * F + c]) * act.host[r * F + c];
                    du_ref[r * F + c] = g * du.host[r * F + c];
                }
                for (int64_t c = 0; c < dim; ++c)
                    rows_ref[r * dim + c] = g * rows.host[r * dim + c];
                dg2_ref[t * k + j] = float(s);
            }
        expect_close("moe gate backward rows: dgates", dgates2.download(), dg2_ref, 1e-5);
        expect_close("moe gate backward rows: du scaled", download_f(du.dev), du_ref, kBf16Tol);
        expect_close("moe gate backward rows: rows scaled", download_f(rows.dev), rows_ref,
                     kBf16Tol);
        // Router: gates = 2.5 s_c / Σ s_chosen through the sigmoid, by central differences.
        cuda::router_backward(ctx(), dprobs, dtopk, dgates, T, E, k, 2.5f, dlogits);
        sync();
        auto dgg = dgates.download();
        std::vector<float> dlr(T * E, 0.f);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < E; ++e) {
                auto f = [&](double delta) {
                    // probs are sigmoid(logit): perturb the logit.
                    std::vector<double> s(E);
                    for (int64_t x = 0; x < E; ++x) {
                        const double p = probs[t * E + x];
                        const double logit = std::log(p / (1 - p)) + (x == e ? delta : 0);
                        s[x] = 1 / (1 + std::exp(-logit));
                    }
                    double S = 1e-20, out = 0;
                    for (int64_t j = 0; j < k; ++j) S += s[topk[t * k + j]];
                    for (int64_t j = 0; j < k; ++j)
                        out += dgg[t * k + j] * 2.5 * s[topk[t * k + j]] / S;
                    return out;
                };
                dlr[t * E + e] = float((f(1e-5) - f(-1e-5)) / 2e-5);
            }
        expect_close("router backward (vs central differences)", dlogits.download(), dlr, 1e-4);
    }
}

// The sequence aux loss against the CPU form: documents spanning several blocks of rows, one
// inside a block, an empty one and padding rows; E not a multiple of the warp. The counts are
// exact, psum is the same bits run after run (fixed-point partial sums), and the loss and the
// logit gradient match.
TEST_F(MoeCuda, SequenceAuxLossMatchesCpu) {
    const int64_t T = 300, E = 40, k = 3, D = 5;
    const std::vector<int32_t> doc_rows = {0, 150, 170, 170, 251, 290};
    std::vector<float> probs = random_vector<float>(T * E, 171, 3.0);
    for (float& p : probs) p = 1.f / (1.f + std::exp(-p));
    std::vector<int32_t> topk(T * k);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) topk[t * k + j] = int32_t((t * 7 + j * 13) % E);
    std::vector<float> fscale(D), w(D);
    for (int64_t d = 0; d < D; ++d) {
        const double n = std::max(1, doc_rows[d + 1] - doc_rows[d]);
        fscale[d] = float(double(E) / (double(k) * n)), w[d] = float(0.37 / double(D) / n);
    }
    std::vector<float> c_ref(D * E), p_ref(D * E);
    cpu::sequence_balance(probs.data(), topk.data(), doc_rows.data(), D, E, k, c_ref.data(),
                          p_ref.data());
    DeviceArray<float> dprobs(probs), dfs(fscale), dw(w), counts(D * E), psum(D * E), f(D * E);
    DeviceArray<int32_t> dtopk(topk), drows(doc_rows);
    DeviceArray<int64_t> work(cuda::sequence_balance_work(D, E));
    DeviceArray<double> loss(std::vector<double>{0.5});  // added to
    cuda::sequence_balance(ctx(), dprobs, dtopk, drows, T, D, E, k, work, counts, psum);
    cuda::sequence_aux_loss(ctx(), counts, psum, dfs, dw, D, E, f, loss);
    sync();
    EXPECT_EQ(counts.download(), c_ref) << "counts are exact";
    const std::vector<float> p1 = psum.download();
    expect_close("sequence aux psum", p1, p_ref, 1e-6);
    double l_ref = 0.5;
    std::vector<float> f_ref(D * E);
    for (int64_t i = 0; i < D * E; ++i) {
        f_ref[i] = c_ref[i] * fscale[i / E];
        l_ref += double(w[i / E]) * f_ref[i] * p_ref[i];
    }
    expect_close("sequence aux f", f.download(), f_ref, 1e-7);
    EXPECT_NEAR(loss.download()[0], l_ref, 1e-6 * l_ref);
    EXPECT_GT(l_ref - 0.5, 1e-3) << "the loss is not negligible";
    cuda::sequence_balance(ctx(), dprobs, dtopk, drows, T, D, E, k, work, counts, psum);
    sync();
    const std::vector<float> p2 = psum.download();
    EXPECT_EQ(0, std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)))
        << "psum is deterministic";
    // Added to: the comparison is of what each form added (double on the host).
    const std::vector<float> base = random_vector<float>(T * E, 172, 1e-3);
    std::vector<double> ref(T * E, 0.0);
    const std::vector<double> probs64(probs.begin(), probs.end()), f64(f_ref.begin(), f_ref.end()),
        w64(w.begin(), w.end());
    cpu::sequence_aux_backward(probs64.data(), doc_rows.data(), D, E, f64.data(), w64.data(),
                               ref.data());
    DeviceArray<float> dl(base);
    cuda::sequence_aux_backward(ctx(), dprobs, drows, T, D, E, f, dw, dl);
    sync();
    const std::vector<float> got = dl.download();
    std::vector<float> added(T * E), added_ref(T * E);
    for (int64_t i = 0; i < T * E; ++i)
        added[i] = float(double(got[i]) - base[i]), added_ref[i] = float(ref[i]);
    expect_close("sequence aux backward (added to dlogits)", added, added_ref, 1e-4);
    for (int64_t i = 290 * E; i < T * E; ++i) EXPECT_EQ(got[i], base[i]) << "padding row";
    expect_guard(dl, "sequence aux backward");
    expect_guard(work, "sequence balance work");
}

#endif  // SPARSETRON_WITH_CUDA
