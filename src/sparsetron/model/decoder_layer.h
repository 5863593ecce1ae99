// One decoder layer (SPEC §1): x_mid = x + MLA_DSA(RMSNorm_in(x)); out = x_mid +
// FFN(RMSNorm_post(x_mid)), FFN = dense SwiGLU or MoE. A DSA layer is "full" (its own indexer,
// top-k and indexer loss) or "shared" (reuses the top-k of its source layer, IndexShare).
#pragma once

#include <memory>
#include <string>

#include "sparsetron/model/dsa_indexer.h"
#include "sparsetron/model/mla_attention.h"
#include "sparsetron/model/mlp.h"
#include "sparsetron/model/moe.h"

namespace sparsetron {

struct LayerLosses {
    double indexer = 0;  // coeff * mean KL (unscaled by the micro-batch weight)
    double aux = 0;      // MoE sequence aux loss (scaled by its micro-batch weight)
};

template <typename T>
class DecoderLayer {
  public:
    struct Slots {
        MemoryPlan::Slot a, rstd_in, x_mid, m, rstd_post, g, u, act;
        typename MlaAttention<T>::Slots attn;
        typename DsaIndexer<T>::Slots idx;
        typename MoeLayer<T>::Slots moe;
    };
    struct Acts {
        T *a, *rstd_in, *x_mid, *m, *rstd_post, *g, *u, *act;
        typename MlaAttention<T>::Acts attn;
        typename DsaIndexer<T>::Acts idx;
        typename MoeLayer<T>::Acts moe;
        // The top-k this application attends over (its own, or its source layer's).
        const int32_t* topk = nullptr;
        const int32_t* topk_len = nullptr;
        bool skip_indexer = false;  // a kv-sharing MTP depth: depth 1 ran the indexer
    };

    // layer0: 0-indexed layer number (the MTP layer is num_layers). key_tokens > 0: context
    // parallelism (this rank's `tokens` rows attend over key_tokens micro-batch rows).
    DecoderLayer(const ModelConfig& cfg, const ParamStore& store, Buffers& buf, int64_t layer0,
                 int64_t tokens, int64_t key_tokens = 0);
    Slots declare_acts(Buffers& buf, const std::string& prefix) const;
    Acts resolve(const Buffers& buf, const Slots& s) const;
    void bind(const Buffers& buf, const std::vector<T*>& params, const std::vector<T*>& grads);

    bool has_indexer() const { return indexer_ != nullptr; }
    int64_t kslots() const { return kslots_; }
    MoeLayer<T>* moe() { return moe_.get(); }
    // The FP8 blockwise recipe for the layer's linears (the MLA projections but kv_b, the dense
    // MLP, the experts' MLPs), as the CUDA model runs them.
    void set_fp8(bool on) {
        attn_->set_fp8(on);
        if (mlp_) mlp_->set_fp8(on, on);
        if (moe_) moe_->set_fp8(on);
    }

    // out = layer(x). A full DSA layer fills A.idx and points A.topk at it; a shared layer must
    // have A.topk set by the caller. indexer_grad_scale: 0 = no indexer gradient.
    LayerLosses forward(Acts& A, const T* x, T* out, const StepInputs& in,
                        double indexer_grad_scale, double aux_scale);
    // dx: in: dL/d out; out: dL/d x. Weight gradients accumulate.
    void backward(const Acts& A, const T* x, T* dx, const StepInputs& in, double aux_scale,
                  T* kv_grad_accum = nullptr);

  private:
    const ModelConfig& c_;
    int64_t layer_, T_, h_, kslots_ = 0;
    int64_t in_norm_, post_norm_;
    std::unique_ptr<MlaAttention<T>> attn_;
    std::unique_ptr<DsaIndexer<T>> indexer_;
    std::unique_ptr<SwiGluMlp<T>> mlp_;
    std::unique_ptr<MoeLayer<T>> moe_;
    std::vector<T*> p_, g_;
    MemoryPlan::Slot s_da_, s_dm_, s_dact_, s_dg_, s_du_;
    T *da_, *dm_, *dact_, *dg_, *du_;
};

}  // namespace sparsetron
