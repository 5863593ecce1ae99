// MLA attention on CUDA: the CPU MlaAttention (model/mla_attention.h) with bf16 activations,
// expanded (dense) or absorbed (sparse over a DSA top-k) execution.
#pragma once

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/cuda/cuda_common.h"
#include "sparsetron/model/cuda/fp8_linear.h"
#include "sparsetron/ops/attention/attention.h"

namespace sparsetron::cuda {

class CudaMlaAttention {
  public:
    struct Acts {
        bf16 *cq_raw, *cq, *q, *ckv, *ckv_n, *kv, *k, *qabs, *kabs, *oabs, *o;
        float *rstd_q, *rstd_kv, *lse;
        const bf16* kabs_shared = nullptr;  // MTP latent-KV sharing: attend over this K'
        // The keys the absorbed attention reads, [key rows, L]: kabs, or under context
        // parallelism every micro-batch row's K' gathered over the CP group.
        bf16* kkeys = nullptr;
        // The masked sparse attention's probabilities from the forward, for the backward
        // (the plan's saved_probs_elems > 0 only).
        bf16* probs = nullptr;
    };
    // dsa: sparse attention over a DSA top-k in the form its plan gives (attention_plan.h): from
    // `teacher` (what the layer's indexer loss reads of it) and `shared_keys` (MTP's kv sharing)
    // besides the shape, the device and the recipe's recompute and FP8. key_tokens > 0: context
    // parallelism (absorbed only): `tokens` rows of this rank attend over key_tokens micro-batch
    // rows.
    CudaMlaAttention(const ModelConfig& cfg, const CudaParams& P, CudaBuffers& B, CudaShared& S,
                     const std::string& hf_prefix, int64_t tokens, bool dsa, int64_t key_tokens = 0,
                     IndexerTeacher teacher = IndexerTeacher::None, bool shared_keys = false);
    void declare(Acts& A, CudaBuffers& B, const std::string& p) const;

    // The down-projections, their norms and RoPE, then up_project().
    void project(const ExecContext& ctx, const Acts& A, const bf16* a, const CudaInputs& in) const;
    // prob_sum (DSA, masked or absorbed forms, may be null): Σ_h attention probabilities per
    // selected key.
    void attend(const ExecContext& ctx, const Acts& A, const CudaInputs& in, const int32_t* idx,
                const int32_t* len, int64_t kslots, bf16* x_accum, float* prob_sum = nullptr) const;
    void backward(const ExecContext& ctx, const Acts& A, const bf16* a, const bf16* dy,
                  const CudaInputs& in, const int32_t* idx, const int32_t* len, int64_t kslots,
                  bf16* da, float* kv_grad_accum) const;
    float scale() const;
    // The sparse attention's plan (DSA layers): its form, workspace and query blocks.
    const SparseAttentionPlan& plan() const { return plan_; }
    // Query rows per block: all `tokens`, or the plan's blocks where the absorbed form over the
    // gathered kernels recomputes its up-projection and core. Each query row attends by index
    // into the whole K', so a block runs its up-projection, core, output projection and their
    // backwards alone, adding its keys' gradients to the others'; q, Q', o', o, the LSE and
    // their gradients then hold one block.
    int64_t query_block() const { return Bq_; }
    int64_t latent_dim() const { return kr_ + dr_; }
    bool absorbed() const { return absorbed_; }
    // attend() fills prob_sum from the masked form's probability kernel (no context parallelism).
    bool gives_prob_sum() const { return dsa_ && plan_.workspace_bytes > 0 && !cp_; }

  private:
    // The query up-projection with its RoPE and Q' (absorbed), or the per-head keys and values
    // (expanded): what recompute_modules' mla_up_proj recomputes before the backward.
    // Query rows [r0, r0 + n) (all of them but in query blocks) into A's row buffers.
    void up_project(const ExecContext& ctx, const Acts& A, const CudaInputs& in, int64_t r0,
                    int64_t n) const;
    // The attention core: o' and o = o' W_UV (absorbed) or o (expanded), with the LSE; what
    // core_attn recomputes. Query rows [r0, r0 + n) as up_project().
    void core(const ExecContext& ctx, const Acts& A, const CudaInputs& in, const int32_t* idx,
              const int32_t* len, int64_t kslots, float* prob_sum, int64_t r0, int64_t n) const;
    // The backward of query rows [r0, r0 + n) from the output projection to q_b's input
    // gradient (dcq_ rows): recompute, o_proj, W_UV, the core (its keys' gradient into dkabs_,
    // added to the earlier blocks' when r0 > 0), W_UK, RoPE, q_b.
    void query_backward(const ExecContext& ctx, const Acts& A, const bf16* dy, const CudaInputs& in,
                        const int32_t* idx, const int32_t* len, int64_t kslots, int64_t r0,
                        int64_t n) const;
    cuda::HeadKV head_kv(const Acts& A) const;
    // The sparse attention's problem in the absorbed form (Q' against the latent keys `keys`) and
    // in the expanded form (per-head keys and values).
    cuda::SparseMqa absorbed(const Acts& A, const bf16* keys, const int32_t* idx,
                             const int32_t* len, int64_t kslots, int64_t r0, int64_t n) const;
    cuda::SparseMha expanded(const Acts& A, const int32_t* idx, const int32_t* len,
                             int64_t kslots) const;
    const ModelConfig& c_;
    const CudaParams& P_;
    CudaShared& S_;
    int64_t T_, h_, H_, dq_, dn_, dr_, dv_, qr_, kr_;
    SparseAttentionPlan plan_;  // DSA layers
    int64_t Bq_;                // query rows per block (query_block())
    bool dsa_;
    bool absorbed_;  // DSA in the absorbed form (else the expanded form, or dense attention)
    bool cp_;        // planned for context parallelism
    int64_t Tk_;     // key rows
    float* keys_f32_ = nullptr;  // CP: [Tk, L] dK' of every key row
    float* cp_xfer_ = nullptr;   // CP: the key exchange's buffer (cp_keys.h)
    int64_t q_a_, q_a_norm_, q_b_, kv_a_, kv_a_norm_, kv_b_, o_;
    // fp8_recipe: blockwise: q_a, q_b, kv_a and o_proj as FP8 linears (kv_b stays bf16: the
    // absorbed attention reads it per head, as a strided batch).
    const Fp8Weights* fp8_ = nullptr;
    int fqa_ = -1, fqb_ = -1, fkva_ = -1, fo_ = -1;
    // Backward scratch (shared by every MLA of the model).
    bf16 *do_, *dq_b_, *dcq_, *dcq_raw_, *dckv_, *dckv_n_, *dqabs_, *doabs_, *dkv_;
    float *dkabs_, *dk32_, *dv32_;
    // The masked forms' workspace (null for the gathered forms).
    float* mqa_ws_ = nullptr;
    ActivationPolicy act_;
    bool recompute_up_, recompute_core_;  // selective recompute of mla_up_proj / core_attn
};

}  // namespace sparsetron::cuda
