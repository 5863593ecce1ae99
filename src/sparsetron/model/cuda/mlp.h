// The dense SwiGLU MLP on CUDA (the CPU model's SwiGluMlp, model/mlp.h): gate and up projections,
// SwiGLU, down projection, in bf16 or as FP8 linears; also the MoE layer's shared expert.
#pragma once

#include <string>

#include "sparsetron/model/cuda/cuda_common.h"
#include "sparsetron/model/cuda/fp8_linear.h"

namespace sparsetron::cuda {

class CudaSwiGluMlp {
  public:
    struct Acts {
        bf16 *g, *u, *act;
    };
    // fp8: the three projections run as FP8 linears (null: bf16). recompute (selective recompute
    // of Megatron's `mlp` module for the dense MLP, `shared_experts` for the shared expert): the
    // gate / up outputs and their SwiGLU are not kept per application; one shared buffer each
    // (`<scratch_tag>.recomputed.*`) and the backward projects them again from its input.
    // block_rows (recompute in bf16 only): the forward and the backward run over blocks of this
    // many rows, so the recomputed rows and their gradients hold one block.
    CudaSwiGluMlp(const CudaParams& P, CudaBuffers& B, const std::string& hf_prefix, int64_t hidden,
                  int64_t ffn, int64_t tokens, const std::string& scratch_tag, bool recompute,
                  Fp8Weights* fp8 = nullptr, int64_t block_rows = 0);
    void declare(Acts& A, CudaBuffers& B, const std::string& p) const;
    // y += down(swiglu(gate(x), up(x))).
    void forward(const ExecContext& ctx, const Acts& A, const bf16* x, bf16* y) const;
    // dx (+)= d x; weight gradients accumulate.
    void backward(const ExecContext& ctx, const Acts& A, const bf16* x, const bf16* dy, bf16* dx,
                  bool accumulate) const;

  private:
    // gate(x), up(x) and their SwiGLU of n rows of x into A (the forward's first half).
    void project_up(const ExecContext& ctx, const Acts& A, const bf16* x, int64_t n) const;
    const CudaParams& P_;
    int64_t h_, f_, T_;
    int64_t Bt_;  // rows per block (T_ unless recomputed in blocks)
    std::string tag_;
    bool recompute_;
    int64_t gate_, up_, down_;
    bf16 *dact_, *dg_, *du_;  // dact_ and dg_ share storage (the constructor)
    const Fp8Weights* fp8_ = nullptr;
    int fgate_ = -1, fup_ = -1, fdown_ = -1;
};

}  // namespace sparsetron::cuda
