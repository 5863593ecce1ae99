// The GLM-5 model on the CPU backend: embedding, L x (RMSNorm, MLA attention, RMSNorm, dense
// SwiGLU), final RMSNorm, and the output head fused with cross-entropy (SPEC §1-2).
//
// Explicit forward and backward (DESIGN §1.3): `forward` saves exactly the activations listed in
// `LayerActs`, whose memory comes from the plan; `backward` consumes them. Templated on the element
// type so the whole model can be gradient-checked in fp64.
#pragma once

#include <memory>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/data/packer.h"
#include "sparsetron/model/param_store.h"

namespace sparsetron {

struct LossSums {
    double lm_loss_sum = 0;  // Σ CE over target rows
    int64_t lm_targets = 0;
};

template <typename T>
class Glm5Model {
  public:
    // Declares parameters, gradients, activations and workspace for micro-batches of `tokens`
    // slots and at most `max_docs` documents. `chunk_rows`: rows per fused head+loss chunk.
    Glm5Model(const ModelConfig& cfg, MemoryPlan& plan, int64_t tokens, int64_t max_docs,
              int64_t chunk_rows);

    // After plan.allocate(): resolves every planned buffer to a pointer.
    void bind();

    const ParamStore& params() const { return *store_; }
    const ModelConfig& config() const { return cfg_; }
    int64_t tokens() const { return T_; }

    // Copies the micro-batch into the planned input buffers.
    void load_inputs(const MicroBatch& mb);
    // Forward (and, if `grad_scale` is non-zero, backward with dLoss/dCE_row = grad_scale for
    // every target row). Parameter gradients accumulate into the gradient arena.
    LossSums forward_backward(double grad_scale, bool backward);

    T* param(int64_t i) const { return param_ptr_[i]; }
    T* grad(int64_t i) const { return grad_ptr_[i]; }

  private:
    struct LayerSlots {
        MemoryPlan::Slot x_in, a, rstd_in, cq_raw, cq, rstd_q, q, ckv, ckv_n, rstd_kv, kv, k, o,
            lse, x_mid, m, rstd_post, g, u, act;
    };
    struct LayerPtrs {
        T *x_in, *a, *rstd_in, *cq_raw, *cq, *rstd_q, *q, *ckv, *ckv_n, *rstd_kv, *kv, *k, *o, *lse,
            *x_mid, *m, *rstd_post, *g, *u, *act;
    };
    struct LayerParams {
        int64_t in_norm, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o, post_norm, gate, up, down;
    };

    void forward_layer(int64_t l);
    void backward_layer(int64_t l, T* dx);

    ModelConfig cfg_;
    MemoryPlan& plan_;
    std::unique_ptr<ParamStore> store_;
    int64_t T_, max_docs_, chunk_rows_;
    std::vector<LayerSlots> slots_;
    std::vector<LayerPtrs> acts_;
    std::vector<LayerParams> lp_;
    int64_t embed_ = 0, final_norm_ = 0, head_ = 0;
    std::vector<T*> param_ptr_, grad_ptr_;

    // Inputs (planned, so a CUDA graph could read them from fixed addresses).
    MemoryPlan::Slot s_tokens_, s_targets_, s_positions_, s_cu_;
    int32_t *tokens_ = nullptr, *targets_ = nullptr, *positions_ = nullptr, *cu_ = nullptr;
    int64_t num_docs_ = 0;
    // Final norm activations.
    MemoryPlan::Slot s_x_final_, s_h_final_, s_rstd_final_;
    T *x_final_ = nullptr, *h_final_ = nullptr, *rstd_final_ = nullptr;
    // Backward workspace, shared by all layers.
    MemoryPlan::Slot s_dx_, s_dh_, s_da_, s_dq_, s_dk_, s_dkv_, s_do_, s_dcq_, s_dckv_, s_dm_,
        s_dg_, s_du_, s_dact_, s_logits_, s_dcq_raw_, s_dckv_n_;
    T *dx_, *dh_, *da_, *dq_, *dk_, *dkv_, *do_, *dcq_, *dckv_, *dm_, *dg_, *du_, *dact_, *logits_,
        *dcq_raw_, *dckv_n_;
};

extern template class Glm5Model<float>;
extern template class Glm5Model<double>;

}  // namespace sparsetron
