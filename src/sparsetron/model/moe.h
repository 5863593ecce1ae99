// MoE layer (SPEC §4): fp32 sigmoid router with expert-bias (noaux_tc) selection, normalized gates
// x routed scaling, routed SwiGLU experts over a per-expert contiguous (permuted) row layout, and
// the shared expert. Padding tokens are not routed and count in no load.
//
// Static shapes: the permuted buffers hold T*k rows; each expert takes at most `capacity` rows
// (moe_capacity_factor; 0 = dropless). Rows over capacity are dropped, counted and reported.
//
// Expert parallelism (cfg.expert_parallel_ranks = W > 1, set_expert_parallel(): W ranks, rank r
// computes experts [r E/W, (r+1) E/W)): the permuted rows are destination-major already, so the
// dispatch is one alltoallv of their blocks (after one of the per-expert counts); the owner runs
// its experts over every source's rows (source by source, expert by expert) and one alltoallv
// sends the outputs back into the permuted layout, where the combine is the one-rank code. The
// backward sends the output gradients the same way and the input gradients back. A rank holds
// only its own experts' weights (cfg.expert_parallel_rank; parameters marked routed_expert), so
// their gradients are summed over the expert-data-parallel group (the ranks holding the same
// experts) and everything else over every rank.
#pragma once

#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/buffers.h"
#include "sparsetron/model/mlp.h"
#include "sparsetron/model/step_inputs.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

template <typename T>
class MoeLayer {
  public:
    struct Slots {
        MemoryPlan::Slot probs, topk, gates, slot_row, perm_token, xperm, g, u, act, out_perm, sg,
            su, sact;
        MemoryPlan::Slot xr = -1, gr = -1, ur = -1, actr = -1;  // expert parallelism
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
        // Expert parallelism: the rows received for this rank's experts (source-major, then
        // expert) and their activations; ep_recv [W x E/W] rows from each source per expert.
        T *xr = nullptr, *gr = nullptr, *ur = nullptr, *actr = nullptr;
        std::vector<int64_t> ep_recv;
    };
    struct Stats {
        std::vector<int64_t> load;  // tokens per expert (accumulated until reset)
        int64_t dropped = 0;
    };

    MoeLayer(const ModelConfig& cfg, const ParamStore& store, Buffers& buf,
             const std::string& hf_prefix, int64_t tokens);
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
    // The expert-parallel group (size cfg.expert_parallel_ranks); null or one rank: local experts.
    void set_expert_parallel(Comm* ep);
    // The FP8 blockwise recipe: the routed experts' forward and input-gradient GEMMs (their
    // weight gradients stay in full precision, as on CUDA) and the shared expert's three.
    void set_fp8(bool on) {
        for (SwiGluMlp<T>& e : experts_) e.set_fp8(on, false);
        if (shared_) shared_->set_fp8(on, on);
    }
    Stats& stats() { return stats_; }
    int64_t capacity() const { return capacity_; }

  private:
    // Router selection and the permutation (ops/moe: cpu::router_topk, cpu::moe_permute) from the
    // router logits (A.probs may hold them: the probabilities replace them).
    void route(Acts& A, const StepInputs& in, const T* logits);
    // The sequence aux loss's per-document terms (ops/moe/sequence_aux.h): f [docs, E] over the
    // whole document (under CP its routed counts are summed over the CP group), this rank's rows'
    // psum [docs, E] (the parts sum to the document's over the group) and the weights w [docs]
    // (aux_scale x coefficient / (documents x the document's rows)).
    struct Balance {
        std::vector<T> f, psum, w;
    };
    Balance document_balance(const Acts& A, const StepInputs& in, double aux_scale) const;
    bool ep() const { return ep_ != nullptr; }
    // Bytes of the permuted rows sent to each rank (row width `width`), and received from each.
    std::vector<int64_t> ep_send_bytes(const Acts& A, int64_t width) const;
    std::vector<int64_t> ep_recv_bytes(const Acts& A, int64_t width) const;
    void ep_forward(Acts& A);
    void ep_backward(const Acts& A) const;
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
    int64_t W_ = 1, El_ = 0;     // expert-parallel ranks, experts per rank
    int64_t received_rows_ = 0;  // expert parallelism: the planned receive rows
    Comm* ep_ = nullptr;
    MemoryPlan::Slot s_outr_ = -1, s_doutr_ = -1, s_dxr_ = -1, s_dactr_ = -1, s_dgr_ = -1,
                     s_dur_ = -1;
    T *outr_ = nullptr, *doutr_ = nullptr, *dxr_ = nullptr, *dactr_ = nullptr, *dgr_ = nullptr,
      *dur_ = nullptr;
};

}  // namespace sparsetron
