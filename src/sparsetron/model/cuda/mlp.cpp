#include "sparsetron/model/cuda/mlp.h"

#include <algorithm>
#include <string>

#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"

namespace sparsetron::cuda {

using cuda::gemm;

CudaSwiGluMlp::CudaSwiGluMlp(const CudaParams& P, CudaBuffers& B, const std::string& p,
                             int64_t hidden, int64_t ffn, int64_t tokens, const std::string& tag,
                             bool recompute, Fp8Weights* fp8, int64_t block_rows)
    : P_(P),
      h_(hidden),
      f_(ffn),
      T_(tokens),
      Bt_(recompute && !fp8 && block_rows > 0 ? std::min(tokens, block_rows) : tokens),
      tag_(tag),
      recompute_(recompute),
      fp8_(fp8) {
    gate_ = P.index(p + "gate_proj.weight");
    up_ = P.index(p + "up_proj.weight");
    down_ = P.index(p + "down_proj.weight");
    if (fp8) {
        fgate_ = fp8->add(gate_);
        fup_ = fp8->add(up_);
        fdown_ = fp8->add(down_);
    }
    // The SwiGLU backward reads each element of the activation's gradient before writing the
    // gate's in its place.
    B.scratch(dact_, "grad." + tag + ".act_then_gate", {Bt_, ffn});
    B.scratch(dg_, "grad." + tag + ".act_then_gate", {Bt_, ffn});
    B.scratch(du_, "grad." + tag + ".up", {Bt_, ffn});
}

void CudaSwiGluMlp::declare(Acts& A, CudaBuffers& B, const std::string& p) const {
    using S = CudaBuffers::Saving;
    const S how = recompute_ ? S::Recomputed : S::Kept;
    const int64_t rows = recompute_ ? Bt_ : T_;
    B.saved(how, A.g, p + "gate", tag_ + ".recomputed.gate", {rows, f_});
    B.saved(how, A.u, p + "up", tag_ + ".recomputed.up", {rows, f_});
    B.saved(how, A.act, p + "act", tag_ + ".recomputed.act", {rows, f_});
}

void CudaSwiGluMlp::project_up(const ExecContext& ctx, const Acts& A, const bf16* x,
                               int64_t n) const {
    if (fp8_) {
        fp8_->quantize_input(ctx, x, h_);
        fp8_->forward_quantized(ctx, fgate_, A.g, f_, false);
        fp8_->forward_quantized(ctx, fup_, A.u, f_, false);
    } else {
        gemm(ctx, false, true, n, f_, h_, 1.f, x, h_, P_[gate_].w, h_, 0.f, A.g, f_);
        gemm(ctx, false, true, n, f_, h_, 1.f, x, h_, P_[up_].w, h_, 0.f, A.u, f_);
    }
    cuda::swiglu_forward(ctx, A.g, A.u, n * f_, A.act);
}

void CudaSwiGluMlp::forward(const ExecContext& ctx, const Acts& A, const bf16* x, bf16* y) const {
    if (fp8_) {
        project_up(ctx, A, x, T_);
        fp8_->forward(ctx, fdown_, A.act, y, h_, true);
        return;
    }
    for (int64_t r0 = 0; r0 < T_; r0 += Bt_) {
        const int64_t n = std::min(Bt_, T_ - r0);
        project_up(ctx, A, x + r0 * h_, n);
        gemm(ctx, false, true, n, h_, f_, 1.f, A.act, f_, P_[down_].w, f_, 1.f, y + r0 * h_, h_);
    }
}

void CudaSwiGluMlp::backward(const ExecContext& ctx, const Acts& A, const bf16* x, const bf16* dy,
                             bf16* dx, bool accumulate) const {
    if (fp8_) {
        if (recompute_) project_up(ctx, A, x, T_);  // the forward's kernels on its input
        fp8_->dgrad(ctx, fdown_, dy, dact_, false);
        fp8_->wgrad(ctx, fdown_, dy, A.act);
        cuda::swiglu_backward(ctx, A.g, A.u, dact_, T_ * f_, dg_, du_);
        fp8_->dgrad(ctx, fgate_, dg_, dx, accumulate);
        fp8_->dgrad(ctx, fup_, du_, dx, true);
        fp8_->quantize_input_columns(ctx, x, h_);
        fp8_->wgrad_quantized(ctx, fgate_, dg_);
        fp8_->wgrad_quantized(ctx, fup_, du_);
        return;
    }
    // Block by block (weight gradients: the first write overwrites, the rest add).
    for (int64_t r0 = 0; r0 < T_; r0 += Bt_) {
        const int64_t n = std::min(Bt_, T_ - r0);
        const bf16 *xb = x + r0 * h_, *dyb = dy + r0 * h_;
        bf16* dxb = dx + r0 * h_;
        if (recompute_) project_up(ctx, A, xb, n);  // the forward's kernels on its input
        gemm(ctx, false, false, n, f_, h_, 1.f, dyb, h_, P_[down_].w, f_, 0.f, dact_, f_);
        gemm(ctx, true, false, h_, f_, n, 1.f, dyb, h_, A.act, f_, P_.grad_beta(down_),
             P_[down_].grad_out(), f_, BF, P_[down_].grad_type());
        cuda::swiglu_backward(ctx, A.g, A.u, dact_, n * f_, dg_, du_);
        gemm(ctx, false, false, n, h_, f_, 1.f, dg_, f_, P_[gate_].w, h_, accumulate ? 1.f : 0.f,
             dxb, h_);
        gemm(ctx, false, false, n, h_, f_, 1.f, du_, f_, P_[up_].w, h_, 1.f, dxb, h_);
        gemm(ctx, true, false, f_, h_, n, 1.f, dg_, f_, xb, h_, P_.grad_beta(gate_),
             P_[gate_].grad_out(), h_, BF, P_[gate_].grad_type());
        gemm(ctx, true, false, f_, h_, n, 1.f, du_, f_, xb, h_, P_.grad_beta(up_),
             P_[up_].grad_out(), h_, BF, P_[up_].grad_type());
    }
}

}  // namespace sparsetron::cuda
