// SwiGLU MLP: down(silu(gate(x)) * up(x)), no biases (SPEC §1). The dense FFN, the shared expert
// and each routed expert are SwiGluMlp instances; activation memory is passed in by the owner
// (the dense layer declares its own, the MoE layer slices its per-expert permuted buffers).
#pragma once

#include <string>

#include "sparsetron/model/param_store.h"

namespace sparsetron {

template <typename T>
struct SwiGluActs {
    T* g;    // [rows, ffn] gate pre-activation
    T* u;    // [rows, ffn] up projection
    T* act;  // [rows, ffn] silu(g) * u
};

template <typename T>
struct SwiGluScratch {
    T* dact;  // [rows, ffn]
    T* dg;
    T* du;
};

template <typename T>
class SwiGluMlp {
  public:
    // Registers `hf_prefix`{gate_proj,up_proj,down_proj}.weight.
    SwiGluMlp(const ParamStore& store, const std::string& hf_prefix, int64_t hidden, int64_t ffn);
    void bind(const std::vector<T*>& params, const std::vector<T*>& grads);

    // y (+)= down(swiglu(gate(x), up(x))) for `rows` rows of x [rows, hidden].
    void forward(const T* x, int64_t rows, const SwiGluActs<T>& a, T* y, bool accumulate) const;
    // dx (+)= dL/dx; weight gradients accumulate.
    void backward(const T* x, const T* dy, int64_t rows, const SwiGluActs<T>& a,
                  const SwiGluScratch<T>& s, T* dx, bool accumulate) const;

    int64_t ffn() const { return f_; }
    // The FP8 blockwise recipe (model/fp8_gemms.h) for the forward and input-gradient GEMMs,
    // and for the weight gradients (the routed experts keep theirs in full precision).
    void set_fp8(bool forward_dgrad, bool wgrad) { fp8_ = forward_dgrad, fp8_wgrad_ = wgrad; }

  private:
    bool fp8_ = false, fp8_wgrad_ = false;
    int64_t h_, f_;
    int64_t gate_, up_, down_;
    T *wg_ = nullptr, *wu_ = nullptr, *wd_ = nullptr, *gwg_ = nullptr, *gwu_ = nullptr,
      *gwd_ = nullptr;
};

}  // namespace sparsetron
