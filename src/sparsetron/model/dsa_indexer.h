// The DSA lightning indexer, its top-k and its KL loss (SPEC §3, §3.1).
//
// Inputs are detached: the indexer reads the normed layer input and the normed q latent but sends
// no gradient into them; its loss trains only wq_b, wk, k_norm and weights_proj, and its gradient
// is computed right after the attention forward (it needs the attention's teacher distribution).
#pragma once

#include <string>

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/buffers.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/model/step_inputs.h"

namespace sparsetron {

template <typename T>
class DsaIndexer {
  public:
    struct Slots {
        MemoryPlan::Slot q, k_raw, k, mean, rstd, w, topk, len;
        MemoryPlan::Slot kfull = -1;  // under CP: every micro-batch row's k_I
    };
    struct Acts {
        T *q, *k_raw, *k, *mean, *rstd, *w;
        int32_t *topk, *len;  // top-k: key rows of the micro-batch
        T* kkeys = nullptr;   // the keys scored, [key rows, dI]: k, or under CP all rows' k_I
    };
    // What the loss needs from the attention: Q' [T, H, L], K' [key rows, L], the sparse LSE
    // [H, T].
    struct Teacher {
        const T* q;
        const T* k;
        const T* lse;
        int64_t heads, dim;
        double scale;
    };

    // key_tokens > 0: context parallelism (this rank's `tokens` rows score key_tokens rows).
    DsaIndexer(const ModelConfig& cfg, const ParamStore& store, Buffers& buf,
               const std::string& hf_prefix, int64_t tokens, int64_t key_tokens = 0);
    Slots declare_acts(Buffers& buf, const std::string& prefix) const;
    Acts resolve(const Buffers& buf, const Slots& s) const;
    void bind(const Buffers& buf, const std::vector<T*>& params, const std::vector<T*>& grads);
    int64_t kslots() const { return K_; }

    // Scores I[t, s] and the top-k of every row (ascending, -1 padded, lengths).
    void forward(const Acts& A, const T* a, const T* cq, const StepInputs& in) const;
    // coeff * mean over valid rows of KL(p || softmax(I)); with grad_scale != 0 also accumulates
    // grad_scale * d(loss)/d(indexer weights). Under CP the mean is over the micro-batch's rows
    // and the value returned is this rank's rows' share (the shares sum to the loss).
    double loss(const Acts& A, const T* a, const T* cq, const StepInputs& in, const Teacher& t,
                double grad_scale) const;

  private:
    // Scores of local row t (micro-batch row `row`) against keys [begin, row]: out[s].
    void scores_row(const Acts& A, int64_t t, int64_t row, int64_t begin, T* out) const;
    const ModelConfig& c_;
    int64_t T_, h_, HI_, dI_, dr_, qr_, K_;
    bool cp_;
    int64_t Tk_;  // key rows
    double wscale_;
    int64_t wq_, wk_, knw_, knb_, ww_;
    std::vector<T*> p_, g_;
    MemoryPlan::Slot s_scores_, s_dq_, s_dk_, s_dw_, s_dkraw_, s_target_, s_dk_keys_ = -1;
    T *scores_, *dq_, *dk_, *dw_, *dkraw_, *target_;
    T* dk_keys_ = nullptr;  // dk_I of every key row (CP; else dk_)
};

}  // namespace sparsetron
