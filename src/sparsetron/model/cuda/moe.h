// The MoE layer on CUDA (the CPU model's MoeLayer, model/moe.h): fp32 router, device-side
// permutation, grouped expert GEMMs (bf16, or FP8 under fp8_recipe: blockwise), the shared expert,
// expert parallelism through the exchange and the paged stash of the saved rows.
#pragma once

#include <memory>
#include <string>

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/cuda/cuda_common.h"
#include "sparsetron/model/cuda/fp8_linear.h"
#include "sparsetron/model/cuda/mlp.h"
#include "sparsetron/model/cuda/moe_stash.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/parallel/expert/expert_exchange.h"

namespace sparsetron::cuda {

class CudaMoeLayer {
  public:
    struct Acts {
        float *m32, *logits, *probs, *gates;
        int32_t *topk, *counts, *offsets, *slot_row, *perm_token;
        // With a paged stash these five are the working buffers every application shares, and
        // `stash_table` records where this application's saved rows went.
        bf16 *xperm, *g, *u, *act, *out_perm;
        int32_t* stash_table = nullptr;
        // Expert parallelism: every rank's offsets [W, E + 1] and this rank's owner layout
        // [El + 1]; xperm, g, u, act then hold the rows this rank's experts received.
        int32_t *ep_offsets = nullptr, *recv_offsets = nullptr;
        CudaSwiGluMlp::Acts shared;
        // The sequence aux loss (moe_aux_loss_coeff > 0): f [docs, E] of this application and
        // the device sum its loss is added to.
        float* aux_f = nullptr;
        double* aux_sum = nullptr;
    };
    // `stash`: the model's paged stash (moe_stash.h), or null to keep every application's
    // expert activations in its own buffers.
    // `max_docs`: the documents a micro-batch holds at most (the sequence aux loss's bound).
    CudaMoeLayer(const ModelConfig& cfg, const CudaParams& P, CudaBuffers& B,
                 const std::string& hf_prefix, int64_t tokens, int64_t max_docs,
                 const MoeStash* stash, Fp8Weights* fp8 = nullptr);
    // bf16 values per stashed row: gate and up outputs (the backward recomputes the SwiGLU and
    // does not read the output rows); under expert parallelism the received input row too.
    static int64_t stash_row_width(const ModelConfig& c) {
        return 2 * c.moe_ffn_hidden_size + (c.expert_parallel_ranks > 1 ? c.hidden_size : 0);
    }
    void declare(Acts& A, CudaBuffers& B, const std::string& p) const;
    // Expert parallelism (cfg.expert_parallel_ranks = W > 1): the exchange with the other
    // ranks' experts, set before the first step; this rank computes experts
    // [rank E / W, (rank + 1) E / W) for every rank's rows.
    void set_exchange(cuda::ExpertExchange* ep) { ep_ = ep; }
    // The eager redo of a step whose routing went over the receive budget
    // (moe_expert_rank_capacity_factor) or the stash: under expert parallelism with a budget
    // below the dropless bound, forward and backward run the routed experts in token chunks
    // whose worst case fits the planned rows (the backward recomputes each chunk's expert rows).
    // Host-side; never inside a captured graph.
    void set_redo(bool on) { redo_ = on; }
    void forward(const ExecContext& ctx, const Acts& A, const bf16* m, const CudaInputs& in,
                 bf16* y) const;
    void backward(const ExecContext& ctx, const Acts& A, const bf16* m, const bf16* dy,
                  const CudaInputs& in, bf16* dm) const;
    // The grouped GEMM reads local expert e's weights at one fixed stride from the first's;
    // throws if the planned parameters are not laid out that way.
    void check_layout() const;
    void reset_stats(const ExecContext& ctx) const;
    void update_bias(const ExecContext& ctx, double rate) const;
    int64_t* load() const { return load_; }        // device [E]
    int64_t* dropped() const { return dropped_; }  // device [1]
    int64_t experts() const { return E_; }

  private:
    bool chunked() const { return redo_ && chunk_tokens_ < T_; }
    // The chunk of tokens [t0, t0 + n) permuted on its own (A.offsets, A.perm_token and its
    // routes' slot_row; counts), gathered and dispatched to the experts' ranks.
    void dispatch_chunk(const ExecContext& ctx, const Acts& A, const bf16* m, int64_t t0,
                        int64_t n) const;
    // The backward of the routed experts for tokens [t0, t0 + n) (all of them, or a redo's
    // chunk), from the output gradients dy to dm and the expert weights' gradients; the expert
    // rows (A.xperm, A.g, A.u, A.act) hold the span's.
    void backward_span(const ExecContext& ctx, const Acts& A, const bf16* m, const bf16* dy,
                       bf16* dm, int64_t t0, int64_t n) const;
    StashRows stashed(const Acts& A) const;
    // Device count of the rows an application keeps in the stash: its routed rows, or under
    // expert parallelism the rows its experts received.
    const int32_t* stashed_rows(const Acts& A) const;
    // Grouped GEMM inputs for this rank's experts: offsets, expert count, rows per expert bound,
    // first expert among the weights this rank holds.
    struct Local {
        const int32_t* offsets;
        int64_t experts, max_rows, first;
    };
    Local local(const Acts& A) const;
    // Whether the local experts' weight gradients are added to (written before in this step, or
    // a step that only accumulates) rather than written; marks them written. One answer for all:
    // one grouped GEMM writes every local expert's gradient.
    bool expert_grads_added(const Local& L) const;
    // One grouped GEMM over the local experts' matrices of one kind (`first`: gate0_, up0_ or
    // down0_, each W [N, K]): y (+)= x W^T, or with `dgrad` y (+)= x W. In FP8 (x quantized into
    // the layer's row scratch, then grouped_gemm_fp8 on W or its W^T copy) where the experts run
    // FP8, the bf16 grouped GEMM otherwise. `x_quantized`: row slot `slot` already holds x
    // (written by x's producer, or the previous call's input: gate and up share theirs).
    // The local experts' weight gradients dW [n, k] (+)= dy_e^T x_e into the gradients from
    // `dw` (the first local expert's) on, `stride` elements apart, in their type.
    cuda::GroupedGemmArgs weight_grad(const Local& L, int64_t n, int64_t k, const bf16* dy,
                                      const bf16* x, const CudaParam& dw, int64_t stride,
                                      bool add) const;
    // The expert rows of the gathered input A.xperm (FP8 copy in row slot 0 where the experts
    // run FP8): gate and up outputs and their SwiGLU; experts_forward also the expert outputs
    // into `out`.
    void experts_swiglu(const ExecContext& ctx, const Local& L, const Acts& A) const;
    void experts_forward(const ExecContext& ctx, const Local& L, const Acts& A, bf16* out) const;
    void expert_gemm(const ExecContext& ctx, const Local& L, int64_t first, bool dgrad,
                     const bf16* x, bf16* y, bool accumulate = false, bool x_quantized = false,
                     int slot = 0) const;
    const ModelConfig& c_;
    const CudaParams& P_;
    const MoeStash* stash_;
    cuda::ExpertExchange* ep_ = nullptr;
    int64_t T_, h_, E_, k_, F_, Fs_, capacity_;
    int64_t Br_ = 0;  // router rows per block (its fp32 input holds one block)
    ActivationPolicy act_;
    bool recompute_act_;  // selective recompute of moe_act (the paged stash recomputes it anyway)
    int64_t W_ = 1, rows_ = 0;  // expert-parallel ranks; expert rows (the receive plan)
    int64_t chunk_tokens_ =
        0;  // tokens per chunk of a redo (ModelConfig::moe_ep_redo_chunk_tokens)
    bool redo_ = false;
    int64_t El_ = 1;              // experts this rank holds (E / W)
    bf16* dout_owner_ = nullptr;  // output gradients received by this rank's experts
    int64_t router_, bias_, gate0_, up0_, down0_, wstride_;
    std::unique_ptr<CudaSwiGluMlp> shared_;
    // FP8 routed experts (fp8_recipe: blockwise): the weights' handles (gate, up, down) and two
    // slots of quantized GEMM input rows (slot 1: the up projection's input gradient, produced
    // beside the gate's by the SwiGLU backward).
    const Fp8Weights* fp8_ = nullptr;
    int fp8_experts_[3] = {-1, -1, -1};
    uint8_t* fp8_rows_[2] = {nullptr, nullptr};
    float* fp8_row_scales_[2] = {nullptr, nullptr};
    // Slot `slot`'s rows as a producer's FP8 output (none when the experts run bf16).
    cuda::Fp8RowsOut rows8(int slot) const;
    // The sequence aux loss's per-document statistics (every application's in turn).
    bool aux_ = false;
    int64_t docs_ = 0;
    int64_t* aux_work_ = nullptr;
    float *aux_counts_ = nullptr, *aux_psum_ = nullptr;
    bf16 *doutperm_, *dact_, *du_, *dlogits_bf_;
    float *dgates_, *dlogits_;
    int64_t *load_, *dropped_;
};

}  // namespace sparsetron::cuda
