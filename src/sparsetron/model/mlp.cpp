#include "sparsetron/model/mlp.h"

#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"

namespace sparsetron {

using cpu::gemm;

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
    gemm<T>(false, true, rows, f_, h_, 1, x, h_, wg_, h_, 0, a.g, f_);
    gemm<T>(false, true, rows, f_, h_, 1, x, h_, wu_, h_, 0, a.u, f_);
    cpu::swiglu_forward(a.g, a.u, rows * f_, a.act);
    gemm<T>(false, true, rows, h_, f_, 1, a.act, f_, wd_, f_, accumulate ? 1 : 0, y, h_);
}

template <typename T>
void SwiGluMlp<T>::backward(const T* x, const T* dy, int64_t rows, const SwiGluActs<T>& a,
                            const SwiGluScratch<T>& s, T* dx, bool accumulate) const {
    if (rows == 0) return;
    gemm<T>(false, false, rows, f_, h_, 1, dy, h_, wd_, f_, 0, s.dact, f_);
    gemm<T>(true, false, h_, f_, rows, 1, dy, h_, a.act, f_, 1, gwd_, f_);
    cpu::swiglu_backward(a.g, a.u, s.dact, rows * f_, s.dg, s.du);
    gemm<T>(false, false, rows, h_, f_, 1, s.dg, f_, wg_, h_, accumulate ? 1 : 0, dx, h_);
    gemm<T>(false, false, rows, h_, f_, 1, s.du, f_, wu_, h_, 1, dx, h_);
    gemm<T>(true, false, f_, h_, rows, 1, s.dg, f_, x, h_, 1, gwg_, h_);
    gemm<T>(true, false, f_, h_, rows, 1, s.du, f_, x, h_, 1, gwu_, h_);
}

template class SwiGluMlp<float>;
template class SwiGluMlp<double>;

}  // namespace sparsetron
