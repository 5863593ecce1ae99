// MoE layer (SPEC §4): fp32 sigmoid router with expert-bias (noaux_tc) selection, normalized gates
// x routed scaling, routed SwiGLU experts over a per-expert contiguous (permuted) row layout, and
// the shared expert. Padding tokens are not routed and count in no load.
//
// Static shapes: the permuted buffers hold T*k rows; each expert takes at most `capacity` rows
// (moe_capacity_factor; 0 = dropless). Rows over capacity are dropped, counted and reported.
#pragma once

#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/buffers.h"
#include "sparsetron/model/mlp.h"
#include "sparsetron/model/step_inputs.h"

namespace sparsetron {

template <typename T>
class MoeLayer {
  public:
    struct Slots {
        MemoryPlan::Slot probs, topk, gates, slot_row, perm_token, xperm, g, u, act, out_perm, sg,
            su, sact;
    };
    struct Acts {
        T* probs;             // [T, E] sigmoid scores
        int32_t* topk;        // [T, k] chosen experts
        T* gates;             // [T, k]
        int32_t* slot_row;    // [T*k] permuted row of (t, j), -1 if not routed (padding or dropped)
        int32_t* perm_token;  // [T*k] token of each permuted row
        T *xperm, *g, *u, *act, *out_perm;  // permuted rows
        T *sg, *su, *sact;                  // shared expert
        std::vector<int64_t> offsets;       // [E+1] permuted row ranges of the last forward
    };
    struct Stats {
        std::vector<int64_t> load;  // tokens per expert (accumulated until reset)
        int64_t dropped = 0;
    };

    MoeLayer(const ModelConfig& cfg, ParamStore& store, Buffers& buf, const std::string& hf_prefix,
             int64_t tokens);
    Slots declare_acts(Buffers& buf, const std::string& prefix) const;
    Acts resolve(const Buffers& buf, const Slots& s) const;
    void bind(const Buffers& buf, const std::vector<T*>& params, const std::vector<T*>& grads);

    // y += MoE(m). Returns this micro-batch's sequence aux loss times `aux_scale` (0: none).
    double forward(Acts& A, const T* m, const StepInputs& in, T* y, double aux_scale);
    // dm (write) from dy; weight grads accumulate.
    void backward(const Acts& A, const T* m, const T* dy, const StepInputs& in, T* dm,
                  double aux_scale) const;

    // Aux-loss-free balancing after an optimizer step: b_e += rate * sign(mean_load - load_e).
    void update_bias(double rate);
    Stats& stats() { return stats_; }
    int64_t capacity() const { return capacity_; }

  private:
    void route(Acts& A, const StepInputs& in);
    // The aux loss's per-expert routed fraction f_e over the document rows [begin, end).
    std::vector<double> expert_fractions(const Acts& A, int64_t begin, int64_t end) const;
    const ModelConfig& c_;
    int64_t T_, h_, E_, k_, F_, Fs_, capacity_;
    int64_t router_, bias_;
    std::vector<SwiGluMlp<T>> experts_;
    std::unique_ptr<SwiGluMlp<T>> shared_;
    std::vector<T*> p_, g_;
    MemoryPlan::Slot s_dxperm_, s_doutperm_, s_dact_, s_dg_, s_du_, s_sdact_, s_sdg_, s_sdu_,
        s_dlogits_;
    T *dxperm_, *doutperm_, *dact_, *dg_, *du_, *sdact_, *sdg_, *sdu_, *dlogits_;
    Stats stats_;
};

}  // namespace sparsetron
