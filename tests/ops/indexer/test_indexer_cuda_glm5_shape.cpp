// The fused wgmma indexer scores (indexer_wgmma.cu) against the CPU's double-precision sum, and
// the top-k's register and streaming kernels against the CPU rule (label gpu). The scores are
// fp32 sums of products of the same bf16 inputs (tolerance 1e-5, as in test_indexer_cuda.cpp);
// every entry outside a row's [begin, row] must keep the value it had (the contract: not written).
#include <gtest/gtest.h>

#include <algorithm>

#include "gpu/harness.h"

#if SPARSETRON_WITH_CUDA
#include "gpu/cuda_session_test.h"
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/indexer/indexer_forms.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(IndexerCudaGlm5Shape, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op harness runs on the GPU machine";
}
#else

class IndexerCudaGlm5Shape : public CudaSessionTest {};

namespace {

// Documents [0, 70), [70, 71), [71, end - 5) and 5 padding rows (row_begin -1).
std::vector<int32_t> doc_row_begin(int64_t tokens) {
    std::vector<int32_t> rb(tokens, -1);
    for (int64_t t = 0; t < tokens - 5; ++t) rb[t] = t < 70 ? 0 : t < 71 ? 70 : 71;
    return rb;
}

// I[t, s] for s in [rb[t], row(t)] in double, and which entries those are.
struct CpuScores {
    std::vector<float> value;
    std::vector<bool> valid;
};
CpuScores cpu_scores(const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& w, const std::vector<int32_t>& rb,
                     const std::vector<int32_t>& key_row, int64_t tokens, int64_t keys,
                     int64_t heads, int64_t dim) {
    CpuScores c{std::vector<float>(tokens * keys, 0.f), std::vector<bool>(tokens * keys, false)};
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t row = key_row.empty() ? t : key_row[t];
        for (int64_t s = rb[t]; rb[t] >= 0 && s <= row; ++s) {
            double acc = 0;
            for (int64_t j = 0; j < heads; ++j) {
                double dot = 0;
                for (int64_t i = 0; i < dim; ++i)
                    dot += double(q[(t * heads + j) * dim + i]) * k[s * dim + i];
                acc += w[t * heads + j] * std::max(dot, 0.0);
            }
            c.value[t * keys + s] = float(acc), c.valid[t * keys + s] = true;
        }
    }
    return c;
}

// Entries outside the rows' ranges that no longer hold `fill`.
int64_t overwritten(const std::vector<float>& got, const std::vector<bool>& valid, float fill) {
    int64_t n = 0;
    for (size_t i = 0; i < got.size(); ++i) n += !valid[i] && got[i] != fill;
    return n;
}

}  // namespace

TEST_F(IndexerCudaGlm5Shape, ScoresMatchCpuForEveryHeadCountAndDim) {
    if (!cuda::indexer_scores_wgmma_supported(32, 128))
        GTEST_SKIP() << "the wgmma indexer needs an sm_90 device";
    // Token counts that leave partial token tiles and partial 64-key fills; three documents and
    // padding rows, so a tile can span a document start.
    struct Shape {
        int64_t heads, dim, tokens;
    };
    for (const Shape sh : {Shape{32, 128, 300}, Shape{16, 64, 137}, Shape{64, 128, 90}}) {
        const int64_t H = sh.heads, d = sh.dim, T = sh.tokens;
        auto qh = random_vector<float>(T * H * d, 201 + H), kh = random_vector<float>(T * d, 202);
        auto w = random_vector<float>(T * H, 203);
        DeviceArray<bf16> q(to_bf16_rounding(qh)), k(to_bf16_rounding(kh));
        DeviceArray<float> dw(w), scores(T * T);
        auto rbv = doc_row_begin(T);
        DeviceArray<int32_t> rb(rbv);
        cuda::fill(ctx(), scores, T * T, -7.f);
        cuda::indexer_scores_wgmma(ctx(), q, k, dw, rb, T, H, d, scores);
        sync();
        const auto ref = cpu_scores(qh, kh, w, rbv, {}, T, T, H, d);
        const auto got = scores.download();
        const std::string what = "wgmma indexer scores, " + std::to_string(H) + " heads x " +
                                 std::to_string(d) + ", " + std::to_string(T) + " tokens";
        expect_close(what, got, ref.value, 1e-5, ref.valid);
        EXPECT_EQ(overwritten(got, ref.valid, -7.f), 0) << what;
        expect_guard(scores, what);
    }
}

TEST_F(IndexerCudaGlm5Shape, ContextParallelKeyRows) {
    if (!cuda::indexer_scores_wgmma_supported(32, 128))
        GTEST_SKIP() << "the wgmma indexer needs an sm_90 device";
    // 96 query rows that are two chunks of a 400-row micro-batch (the context-parallel layout):
    // rows 0..47 are key rows 100..147, rows 48..95 key rows 300..347; one document from key 20.
    const int64_t H = 32, d = 128, T = 96, keys = 400;
    std::vector<int32_t> key_row(T), rbv(T, 20);
    for (int64_t t = 0; t < T; ++t) key_row[t] = int32_t(t < 48 ? 100 + t : 300 + t - 48);
    auto qh = random_vector<float>(T * H * d, 211), kh = random_vector<float>(keys * d, 212);
    auto w = random_vector<float>(T * H, 213);
    DeviceArray<bf16> q(to_bf16_rounding(qh)), k(to_bf16_rounding(kh));
    DeviceArray<float> dw(w), scores(T * keys);
    DeviceArray<int32_t> rb(rbv), kr(key_row);
    cuda::fill(ctx(), scores, T * keys, -7.f);
    cuda::indexer_scores_wgmma(ctx(), q, k, dw, rb, T, H, d, scores, kr, keys);
    sync();
    const auto ref = cpu_scores(qh, kh, w, rbv, key_row, T, keys, H, d);
    const auto got = scores.download();
    expect_close("wgmma indexer scores, key rows", got, ref.value, 1e-5, ref.valid);
    EXPECT_EQ(overwritten(got, ref.valid, -7.f), 0);
}

TEST_F(IndexerCudaGlm5Shape, TopkEveryRowLengthClassMatchesCpuRule) {
    // The streaming top-k at strides up to 40000 keys. Rows of several lengths per stride (key_row
    // sets a row's last key), half of them drawn from 7 values so ties straddle the k-th place.
    const int64_t K = 2048, rows = 6;
    for (int64_t ld :
         {int64_t(4096), int64_t(8192), int64_t(16384), int64_t(32768), int64_t(40000)}) {
        std::vector<float> s(rows * ld);
        CounterRng rng(221, uint64_t(ld));
        for (int64_t i = 0; i < rows * ld; ++i) {
            const bool tied = (i / ld) % 2 == 1;
            s[i] = tied ? float(int(rng.bits(i) % 7) - 3) * 0.5f
                        : float(int64_t(rng.bits(i) % 2000001) - 1000000) * 1e-3f;
        }
        // Lengths: below k (all taken), just over k, the stride's half and its whole.
        std::vector<int32_t> rbv(rows), key_row(rows);
        const int64_t last[rows] = {1000, K + 1, ld / 2, ld / 2 + 17, ld - 1, ld - 1};
        for (int64_t t = 0; t < rows; ++t) rbv[t] = t == 4 ? 5 : 0, key_row[t] = int32_t(last[t]);
        DeviceArray<float> ds(s);
        DeviceArray<int32_t> rb(rbv), kr(key_row);
        DeviceArray<int32_t> idx(rows * K), len(rows);
        cuda::topk_rows(ctx(), ds, ld, rb, rows, K, idx, len, kr);
        sync();
        const auto ig = idx.download(), lg = len.download();
        for (int64_t t = 0; t < rows; ++t) {
            const int64_t n = key_row[t] - rbv[t] + 1;
            const auto ref = reference_topk(s.data() + t * ld, rbv[t], n, K);
            EXPECT_TRUE(std::equal(ref.begin(), ref.end(), ig.begin() + t * K))
                << "stride " << ld << ", row " << t << " (" << n << " keys)";
            EXPECT_EQ(lg[t], std::min<int64_t>(K, n)) << "stride " << ld;
        }
        expect_guard(idx, "top-k idx");
    }
}

#endif
