#include "sparsetron/model/cuda/fp8_linear.h"

#include <algorithm>

#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace sparsetron::cuda {

namespace {

// Each part on the memory plan's alignment, as a buffer of its own would be.
int64_t aligned(int64_t bytes) {
    constexpr int64_t a = int64_t(MemoryPlan::kAlignment);
    return (bytes + a - 1) / a * a;
}

// Offsets of the parts of an Fp8Copy block: W, its scales, W^T, its scales.
struct CopyLayout {
    int64_t s, qt, st, end;
    CopyLayout(int64_t rows, int64_t cols) {
        const int64_t n = rows * cols;
        s = aligned(n);
        qt = s + aligned(fp8::scales_128x128(rows, cols) * int64_t(sizeof(float)));
        st = qt + aligned(n);
        end = st + aligned(fp8::scales_128x128(cols, rows) * int64_t(sizeof(float)));
    }
};

}  // namespace

int64_t Fp8Copy::bytes(int64_t rows, int64_t cols) {
    return CopyLayout(rows, cols).end;
}
float* Fp8Copy::s() const {
    return reinterpret_cast<float*>(block + CopyLayout(rows, cols).s);
}
uint8_t* Fp8Copy::qt() const {
    return block + CopyLayout(rows, cols).qt;
}
float* Fp8Copy::st() const {
    return reinterpret_cast<float*>(block + CopyLayout(rows, cols).st);
}

void quantize_fp8_copy(const ExecContext& ctx, const float* master, const Fp8Copy& c) {
    cuda::quantize_fp8_128x128_both(ctx, master, c.rows, c.cols, kFp8Pow2Scales, c.q(), c.s(),
                                    c.qt(), c.st());
}

int Fp8Weights::add(int64_t param) {
    for (size_t i = 0; i < w_.size(); ++i)
        if (w_[i].param == param) return int(i);
    const ParamInfo& info = P_.store().params()[size_t(param)];
    ST_CHECK(info.shape.size() == 2, "FP8 linear '", info.name, "' is not a matrix");
    Weight w;
    w.param = param;
    w.copy.rows = info.shape[0];
    w.copy.cols = info.shape[1];
    // cuBLASLt's block-scaled GEMM contracts over multiples of 16: K (forward), N (dgrad).
    ST_CHECK(w.copy.rows % 16 == 0 && w.copy.cols % 16 == 0,
             "fp8_recipe: blockwise needs the weight '", info.name, "' [", w.copy.rows, ", ",
             w.copy.cols, "] to have multiples of 16 on both sides");
    w_.push_back(w);
    widest_ = std::max({widest_, w.copy.rows, w.copy.cols});
    return int(w_.size() - 1);
}

int Fp8Weights::add_experts(int64_t first, int64_t stride, int64_t count) {
    for (size_t i = 0; i < experts_.size(); ++i)
        if (experts_[i].first == first) return int(i);
    const ParamInfo& info = P_.store().params()[size_t(first)];
    ST_CHECK(info.shape.size() == 2, "FP8 expert weight '", info.name, "' is not a matrix");
    Experts x;
    x.first = first, x.stride = stride, x.count = count;
    x.rows = info.shape[0], x.cols = info.shape[1];
    // The grouped FP8 GEMM's bulk copies step through rows of K bytes (both orientations).
    ST_CHECK(x.rows % 16 == 0 && x.cols % 16 == 0,
             "fp8_recipe: blockwise needs the expert weight '", info.name, "' [", x.rows, ", ",
             x.cols, "] to have multiples of 16 on both sides");
    experts_.push_back(x);
    return int(experts_.size() - 1);
}

std::vector<int64_t> Fp8Weights::params() const {
    std::vector<int64_t> out;
    for (const Weight& w : w_) out.push_back(w.param);
    for (const Experts& x : experts_)
        for (int64_t e = 0; e < x.count; ++e) out.push_back(x.first + e * x.stride);
    return out;
}

std::vector<int64_t> Fp8Weights::quantized_here() const {
    std::vector<int64_t> out;
    for (const Weight& w : w_)
        if (!w.gathered) out.push_back(w.param);
    for (const Experts& x : experts_)
        for (int64_t e = 0; e < x.count; ++e) out.push_back(x.first + e * x.stride);
    return out;
}

void Fp8Weights::bind(CudaParams& P) const {
    for (const Weight& w : w_)
        if (w.gathered) P.gather_in_fp8(w.param, &w.copy);
}

cuda::Fp8Operand Fp8Weights::Experts::forward(int64_t e0) const {
    return {q + e0 * rows * cols, s + e0 * fp8::scales_128x128(rows, cols), true};
}

cuda::Fp8Operand Fp8Weights::Experts::dgrad(int64_t e0) const {
    return {qt + e0 * rows * cols, st + e0 * fp8::scales_128x128(cols, rows), true};
}

void Fp8Weights::declare() {
    ST_CHECK(T_ % 16 == 0,
             "fp8_recipe: blockwise needs micro-batch rows in multiples of 16 (the "
             "weight gradient contracts over them); this run has ",
             T_);
    for (Weight& w : w_)  // W, its scales, W^T, its scales
        B_.param_copy(w.copy.block, P_.store().params()[size_t(w.param)].name + ".fp8",
                      {w.copy.bytes()});
    for (Experts& x : experts_) {
        const std::string n = P_.store().params()[size_t(x.first)].name + ".experts";
        B_.param_copy(x.q, n + ".fp8", {x.count, x.rows, x.cols});
        B_.param_copy(x.s, n + ".fp8_scales", {x.count * fp8::scales_128x128(x.rows, x.cols)});
        B_.param_copy(x.qt, n + ".fp8_transposed", {x.count, x.cols, x.rows});
        B_.param_copy(x.st, n + ".fp8_transposed_scales",
                      {x.count * fp8::scales_128x128(x.cols, x.rows)});
    }
    if (w_.empty()) return;
    // Two operands' worth: the weight gradient quantizes dy^T and x^T at once. 1x128 scales of
    // [widest, T] cover every operand ([T, widest] ones too: blocks(T) x widest >= their count).
    const int64_t elems = T_ * widest_;
    const int64_t scales = std::max(fp8::scales_1x128(T_, widest_), fp8::scales_1x128(widest_, T_));
    B_.scratch(qa_, "fp8.operand_a", {elems});
    B_.scratch(qb_, "fp8.operand_b", {elems});
    B_.scratch(sa_, "fp8.operand_a_scales", {scales});
    B_.scratch(sb_, "fp8.operand_b_scales", {scales});
}

void Fp8Weights::quantize(const ExecContext& ctx) const {
    for (const Weight& w : w_)
        if (!w.gathered) quantize_fp8_copy(ctx, P_[w.param].master, w.copy);
    // One launch per layer and kind for the experts, their masters one stride apart
    // (CudaMoeLayer::check_layout holds the store to that at bind): a launch per expert leaves the
    // SMs idle between small grids.
    for (const Experts& x : experts_) {
        const float* m0 = P_[x.first].master;
        const int64_t ms = x.count > 1 ? P_[x.first + x.stride].master - m0 : 0;
        cuda::quantize_fp8_128x128_both(ctx, m0, x.rows, x.cols, kFp8Pow2Scales, x.q, x.s, x.qt,
                                        x.st, x.count, ms);
    }
}

void Fp8Weights::quantize_input(const ExecContext& ctx, const bf16* x, int64_t k) const {
    cuda::quantize_fp8_1x128(ctx, x, T_, k, k, kFp8Pow2Scales, qa_, sa_);
    a_cols_ = k;
}

void Fp8Weights::forward_quantized(const ExecContext& ctx, int i, bf16* y, int64_t ldy,
                                   bool accumulate) const {
    const Fp8Copy& c = w_[size_t(i)].copy;
    ST_ASSERT(a_cols_ == c.cols, "FP8 linear: the quantized input has ", a_cols_,
              " columns, the weight takes ", c.cols);
    cuda::gemm_fp8_blockwise(ctx, T_, c.rows, c.cols, {qa_, sa_, false}, {c.q(), c.s(), true}, y,
                             ldy, accumulate);
}

void Fp8Weights::quantize_input_columns(const ExecContext& ctx, const bf16* x, int64_t k) const {
    cuda::quantize_fp8_1x128_columns(ctx, x, T_, k, k, kFp8Pow2Scales, qb_, sb_);
    b_cols_ = k;
}

void Fp8Weights::wgrad_quantized(const ExecContext& ctx, int i, const bf16* dy) const {
    const Weight& w = w_[size_t(i)];
    const Fp8Copy& c = w.copy;
    ST_ASSERT(b_cols_ == c.cols, "FP8 linear: the quantized input has ", b_cols_,
              " columns, the weight takes ", c.cols);
    cuda::quantize_fp8_1x128_columns(ctx, dy, T_, c.rows, c.rows, kFp8Pow2Scales, qa_, sa_);
    a_cols_ = -1;
    const CudaParam& g = P_[w.param];
    const bool add = P_.grad_beta(w.param) != 0.f;
    if (g.grad16)
        cuda::gemm_fp8_blockwise(ctx, c.rows, c.cols, T_, {qa_, sa_, false}, {qb_, sb_, false},
                                 g.grad16, c.cols, add);
    else
        cuda::gemm_fp8_blockwise(ctx, c.rows, c.cols, T_, {qa_, sa_, false}, {qb_, sb_, false},
                                 g.grad, c.cols, add);
}

void Fp8Weights::forward(const ExecContext& ctx, int i, const bf16* x, bf16* y, int64_t ldy,
                         bool accumulate) const {
    quantize_input(ctx, x, w_[size_t(i)].copy.cols);
    forward_quantized(ctx, i, y, ldy, accumulate);
}

void Fp8Weights::dgrad(const ExecContext& ctx, int i, const bf16* dy, bf16* dx,
                       bool accumulate) const {
    const Fp8Copy& c = w_[size_t(i)].copy;
    cuda::quantize_fp8_1x128(ctx, dy, T_, c.rows, c.rows, kFp8Pow2Scales, qa_, sa_);
    a_cols_ = -1;
    cuda::gemm_fp8_blockwise(ctx, T_, c.cols, c.rows, {qa_, sa_, false}, {c.qt(), c.st(), true}, dx,
                             c.cols, accumulate);
}

void Fp8Weights::wgrad(const ExecContext& ctx, int i, const bf16* dy, const bf16* x) const {
    quantize_input_columns(ctx, x, w_[size_t(i)].copy.cols);
    wgrad_quantized(ctx, i, dy);
}

}  // namespace sparsetron::cuda
