// MLA attention (SPEC §2) in two executions of the same math:
//  - expanded: K_h = [k_nope_h ; k_pe], V_h per head, dense causal attention within documents;
//  - absorbed: Q'_h = [q_nope_h W_UK^h ; q_pe_h], one latent key K' = [c_kv ; k_pe], V' = c_kv,
//    attention over the keys a DSA top-k selected, o_h = o'_h W_UV^h^T (what sparse attention
//    runs).
// The forward is split so a DSA indexer can run between the projections and the attention core.
#pragma once

#include <string>

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/buffers.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/model/step_inputs.h"

namespace sparsetron {

template <typename T>
class MlaAttention {
  public:
    struct Slots {
        MemoryPlan::Slot cq_raw, cq, rstd_q, q, ckv, ckv_n, rstd_kv;
        MemoryPlan::Slot kv, k;             // expanded
        MemoryPlan::Slot qabs, kabs, oabs;  // absorbed
        MemoryPlan::Slot kfull;             // absorbed under CP: every micro-batch row's K'
        MemoryPlan::Slot o, lse;
    };
    struct Acts {
        T *cq_raw, *cq, *rstd_q, *q, *ckv, *ckv_n, *rstd_kv, *kv, *k, *qabs, *kabs, *oabs, *o, *lse;
        // The keys the absorbed attention reads, [key rows, L]: kabs, or under context
        // parallelism every micro-batch row's K' gathered from the CP group.
        T* kkeys = nullptr;
        // Latent-KV sharing (repeated MTP, dsa_mtp_index_kv_share): attend over another
        // application's K' instead of computing one; only the query path runs here.
        const T* kabs_shared = nullptr;
    };

    // key_tokens > 0: context parallelism, `tokens` of this rank's rows attend over key_tokens
    // micro-batch rows (absorbed mode only).
    MlaAttention(const ModelConfig& cfg, const ParamStore& store, Buffers& buf,
                 const std::string& hf_prefix, int64_t tokens, bool absorbed,
                 int64_t key_tokens = 0);
    Slots declare_acts(Buffers& buf, const std::string& prefix) const;
    Acts resolve(const Buffers& buf, const Slots& s) const;
    void bind(const Buffers& buf, const std::vector<T*>& params, const std::vector<T*>& grads);

    bool absorbed() const { return absorbed_; }
    // Phase 1: q/kv projections, latent norms and RoPE from the normed input `a` [T, h].
    void project(const Acts& A, const T* a, const StepInputs& in) const;
    // Phase 2: the attention core. Absorbed mode attends over idx/len ([T, kslots]); expanded mode
    // ignores them (dense causal within documents). Then x_accum += o_proj(o).
    void attend(const Acts& A, const StepInputs& in, const int32_t* idx, const int32_t* len,
                int64_t kslots, T* x_accum) const;
    // dy: gradient of x_accum; da (write): gradient of the normed input. Weight grads accumulate.
    // kv_grad_accum ([T, L], absorbed mode): an application with kabs_shared adds its dK' there;
    // the application that owns that K' adds the accumulated gradient to its own first.
    void backward(const Acts& A, const T* a, const T* dy, const StepInputs& in, const int32_t* idx,
                  const int32_t* len, int64_t kslots, T* da, T* kv_grad_accum = nullptr) const;

    double scale() const;
    int64_t latent_dim() const { return kr_ + dr_; }  // 576 for GLM-5
    // q_a, q_b, kv_a and o_proj in the FP8 blockwise recipe (model/fp8_gemms.h); kv_b stays out,
    // as on CUDA.
    void set_fp8(bool on) { fp8_ = on; }

  private:
    bool fp8_ = false;
    const ModelConfig& c_;
    int64_t T_, h_, H_, dq_, dn_, dr_, dv_, qr_, kr_;
    bool absorbed_;
    bool cp_;     // planned for context parallelism
    int64_t Tk_;  // key rows
    int64_t q_a_, q_a_norm_, q_b_, kv_a_, kv_a_norm_, kv_b_, o_;
    std::vector<T*> p_, g_;
    // Shared backward scratch.
    MemoryPlan::Slot s_do_, s_dq_, s_dk_, s_dkv_, s_dcq_, s_dcq_raw_, s_dckv_, s_dckv_n_, s_dqabs_,
        s_dkabs_, s_dkabs_heads_, s_doabs_, s_dkabs_keys_ = -1;
    T *do_, *dq_b_, *dk_, *dkv_, *dcq_, *dcq_raw_, *dckv_, *dckv_n_, *dqabs_, *dkabs_,
        *dkabs_heads_, *doabs_;
    T* dkabs_keys_ = nullptr;  // dK' of every key row (CP; else dkabs_)
};

}  // namespace sparsetron
