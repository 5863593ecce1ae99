// FP8 blockwise linear layers (`fp8_recipe: blockwise`, SPEC §6): the DeepSeek-V3 recipe on
// Hopper's block-scaled cuBLASLt GEMMs. For a linear y = x W^T (x [T, K], W [N, K]):
//   forward  y  = x W^T     x 1x128 along K,          W 128x128
//   dgrad    dx = dy W      dy 1x128 along N,         W^T 128x128 (a transposed copy)
//   wgrad    dW += dy^T x   dy^T and x^T, 1x128 along T (tokens), into the fp32 gradient
// All e4m3, scales by Transformer Engine's rule rounded down to powers of two. The weights are
// quantized from the fp32 masters once per forward (Fp8Weights::quantize, inside the step's
// graph), W and W^T both, so no bf16 weight is read by these GEMMs; activations and gradients
// are quantized on the fly into shared scratch. Under the distributed optimizer with
// fp8_param_gather a dense weight's master lives on its owner alone, which quantizes it after
// each update and broadcasts the FP8 copy (CudaParam::fp8, CudaOptimizer): the forward then
// reads the copy as it arrived. The routed experts' forward and input-gradient
// GEMMs run FP8 through the grouped FP8 kernel (add_experts: every expert's W and W^T, packed);
// their weight gradients stay bf16 (an FP8 form needs the tokens quantized per expert segment).
// Router, norms, the indexer and the absorbed attention core stay bf16 (SPEC §6 keeps the first
// three out; the last has no FP8 kernel here yet); the output head too unless fp8_output_proj
// (its GEMMs then quantize inside head_cross_entropy, ops/loss/loss.h, from the model's copy).
#pragma once

#include <vector>

#include "sparsetron/model/cuda/cuda_common.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace sparsetron::cuda {

using cpu::kFp8Pow2Scales;  // the recipe's power-of-two scales (ops/fp8/fp8.h)

// W and W^T of `copy` from the fp32 master W.
void quantize_fp8_copy(const ExecContext& ctx, const float* master, const Fp8Copy& copy);

class Fp8Weights {
  public:
    struct Weight {
        int64_t param = -1;     // CudaParams index
        Fp8Copy copy;           // W [rows = N, cols = K], W^T [K, N] and their 128x128 scales
        bool gathered = false;  // from its owner (fp8_param_gather), not quantized here
    };
    // One MoE layer's routed-expert matrices of one kind (gate, up or down): `count` parameters
    // [rows, cols] `stride` parameter indices apart, their FP8 copies packed expert after expert.
    struct Experts {
        int64_t first = -1, stride = 0, count = 0;
        int64_t rows = 0, cols = 0;  // each W [rows = N, cols = K]
        uint8_t* q = nullptr;        // [count][N][K]
        float* s = nullptr;          // 128x128 scales, fp8::scales_128x128(N, K) per expert
        uint8_t* qt = nullptr;       // [count][K][N]
        float* st = nullptr;
        cuda::Fp8Operand forward(int64_t e0) const;  // W of experts e0.. (the x W^T operand)
        cuda::Fp8Operand dgrad(int64_t e0) const;    // their W^T (the dy W operand)
    };
    Fp8Weights(const CudaParams& P, CudaBuffers& B, int64_t tokens) : P_(P), B_(B), T_(tokens) {}
    // Registers parameter `param` ([rows, cols]) as an FP8 linear weight (once per parameter:
    // a module used several times, like the MTP layer, registers once) and returns its handle.
    int add(int64_t param);
    // Registers routed-expert matrices (once per first parameter) and returns their handle.
    int add_experts(int64_t first, int64_t stride, int64_t count);
    const Experts& experts(int h) const { return experts_[size_t(h)]; }
    // The dense linears whose masters the distributed optimizer keeps on one rank of several
    // (`sharded(param)`) take their FP8 copies from that rank (fp8_param_gather); before
    // declare(). The experts' copies are quantized where their masters are: under expert
    // parallelism each rank keeps its own experts' masters.
    template <typename Sharded>
    void gather_from_owners(Sharded sharded) {
        for (Weight& w : w_) w.gathered = sharded(w.param);
    }
    // Every registered parameter (linears and experts): read only through their FP8 copies.
    std::vector<int64_t> params() const;
    // Those quantized here from their masters (every one but the gathered linears).
    std::vector<int64_t> quantized_here() const;
    // After the plan's buffers are resolved: the gathered linears' copies to CudaParams.
    void bind(CudaParams& P) const;
    // Plans the copies and the activation scratch; after every add(), before allocation.
    void declare();
    // W and W^T from the fp32 masters, every registered weight and expert but the gathered.
    void quantize(const ExecContext& ctx) const;

    // y [T, N] (row stride ldy) (+)= x [T, K] W^T.
    void forward(const ExecContext& ctx, int w, const bf16* x, bf16* y, int64_t ldy,
                 bool accumulate) const;
    // dx [T, K] (+)= dy [T, N] W.
    void dgrad(const ExecContext& ctx, int w, const bf16* dy, bf16* dx, bool accumulate) const;
    // W's fp32 gradient += dy^T x.
    void wgrad(const ExecContext& ctx, int w, const bf16* dy, const bf16* x) const;

    // Linears that share an input quantize it once: quantize_input(x [T, K]) then
    // forward_quantized() for each (until the next quantize_input, forward or dgrad);
    // quantize_input_columns(x) then wgrad_quantized(dy) for each (until the next
    // quantize_input_columns or wgrad).
    void quantize_input(const ExecContext& ctx, const bf16* x, int64_t k) const;
    void forward_quantized(const ExecContext& ctx, int w, bf16* y, int64_t ldy,
                           bool accumulate) const;
    void quantize_input_columns(const ExecContext& ctx, const bf16* x, int64_t k) const;
    void wgrad_quantized(const ExecContext& ctx, int w, const bf16* dy) const;

  private:
    const CudaParams& P_;
    CudaBuffers& B_;
    int64_t T_;
    std::vector<Weight> w_;
    std::vector<Experts> experts_;
    int64_t widest_ = 0;  // the largest N or K: the activation scratch's width
    uint8_t *qa_ = nullptr, *qb_ = nullptr;
    float *sa_ = nullptr, *sb_ = nullptr;
    // What the operand slots hold (host-side bookkeeping, checked by the *_quantized calls).
    mutable int64_t a_cols_ = -1, b_cols_ = -1;
};

}  // namespace sparsetron::cuda
