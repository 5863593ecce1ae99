#include "sparsetron/model/mlp.h"

#include "sparsetron/model/fp8_gemms.h"
#include "sparsetron/ops/elementwise/elementwise.h"

namespace sparsetron {

template <typename T>
SwiGluMlp<T>::SwiGluMlp(const ParamStore& store, const std::string& p, int64_t hidden, int64_t ffn)
    : h_(hidden), f_(ffn) {
    gate_ = store.index(p + "gate_proj.weight");
    up_ = store.index(p + "up_proj.weight");
    down_ = store.index(p + "down_proj.weight");
}

template <typename T>
void SwiGluMlp<T>::bind(const std::vector<T*>& params, const std::vector<T*>& grads) {
    wg_ = params[gate_], wu_ = params[up_], wd_ = params[down_];
    gwg_ = grads[gate_], gwu_ = grads[up_], gwd_ = grads[down_];
}

template <typename T>
void SwiGluMlp<T>::forward(const T* x, int64_t rows, const SwiGluActs<T>& a, T* y,
                           bool accumulate) const {
    if (rows == 0) return;
    linear_forward(fp8_, x, h_, rows, h_, wg_, f_, a.g, f_, false);
    linear_forward(fp8_, x, h_, rows, h_, wu_, f_, a.u, f_, false);
    cpu::swiglu_forward(a.g, a.u, rows * f_, a.act);
    linear_forward(fp8_, a.act, f_, rows, f_, wd_, h_, y, h_, accumulate);
}

template <typename T>
void SwiGluMlp<T>::backward(const T* x, const T* dy, int64_t rows, const SwiGluActs<T>& a,
                            const SwiGluScratch<T>& s, T* dx, bool accumulate) const {
    if (rows == 0) return;
    linear_dgrad(fp8_, dy, h_, rows, h_, wd_, f_, s.dact, f_, false);
    linear_wgrad(fp8_wgrad_, dy, h_, rows, h_, a.act, f_, f_, gwd_);
    cpu::swiglu_backward(a.g, a.u, s.dact, rows * f_, s.dg, s.du);
    linear_dgrad(fp8_, s.dg, f_, rows, f_, wg_, h_, dx, h_, accumulate);
    linear_dgrad(fp8_, s.du, f_, rows, f_, wu_, h_, dx, h_, true);
    linear_wgrad(fp8_wgrad_, s.dg, f_, rows, f_, x, h_, h_, gwg_);
    linear_wgrad(fp8_wgrad_, s.du, f_, rows, f_, x, h_, h_, gwu_);
}

template class SwiGluMlp<float>;
template class SwiGluMlp<double>;

}  // namespace sparsetron
