// CPU reference kernels (DESIGN §1.2): plain loops over raw pointers, templated on the element
// type so tests can run them in fp64 against finite differences. GEMMs go through OpenBLAS.
// Parameter gradients accumulate (+=); activation gradients are written unless `accumulate`.
#pragma once

#include <cstdint>

namespace sparsetron::cpu {

// C[m,n] = alpha * op(A) @ op(B) + beta * C, row-major with leading dimensions.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

template <typename T>
void embedding_forward(const int32_t* tokens, int64_t rows, const T* table, int64_t vocab,
                       int64_t dim, T* out);
template <typename T>
void embedding_backward(const int32_t* tokens, int64_t rows, const T* dout, int64_t vocab,
                        int64_t dim, T* dtable);

// y = w * x / sqrt(mean(x^2) + eps) per row; rstd[r] = 1/sqrt(mean + eps). Row strides allowed.
template <typename T>
void rmsnorm_forward(const T* x, int64_t ldx, const T* w, int64_t rows, int64_t dim, double eps,
                     T* y, int64_t ldy, T* rstd);
template <typename T>
void rmsnorm_backward(const T* dy, int64_t lddy, const T* x, int64_t ldx, const T* w, const T* rstd,
                      int64_t rows, int64_t dim, T* dx, int64_t lddx, bool accumulate, T* dw);

// Rotates pairs of x[t, h, 0:dim] (row stride ld_t, head stride ld_h) by position[t] * inv_freq.
// interleaved: pairs (2i, 2i+1); otherwise (i, i + dim/2). inverse: rotate by -angle (backward).
template <typename T>
void rope(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_t, int64_t ld_h,
          const int32_t* positions, double theta, bool interleaved, bool inverse);

// Causal attention within packed documents. q,k: [T, H, dqk], v: [T, H, dv] with token/head
// strides (unit stride inside a head); out: [T, H, dv] contiguous; lse: [H, T].
// Rows outside every document (padding) get out = 0 and lse = 0.
struct AttnShape {
    int64_t tokens, heads, dqk, dv;
    int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh;  // strides (tokens, heads)
};
template <typename T>
void attention_forward(const AttnShape& s, const T* q, const T* k, const T* v,
                       const int32_t* cu_seqlens, int64_t num_docs, double scale, T* out, T* lse);
// dq, dk: same strides as q, k; dv: same strides as v. All three are overwritten.
template <typename T>
void attention_backward(const AttnShape& s, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, const T* dout, const int32_t* cu_seqlens, int64_t num_docs,
                        double scale, T* dq, T* dk, T* dv);

template <typename T>
void swiglu_forward(const T* g, const T* u, int64_t n, T* out);
template <typename T>
void swiglu_backward(const T* g, const T* u, const T* dout, int64_t n, T* dg, T* du);

// Output head fused with cross-entropy over row chunks: for each chunk, logits = h @ W^T in
// `logits_ws` [chunk_rows, vocab]; loss_sum += Σ CE over rows with target >= 0. With dh/dw:
// dlogits = grad_scale * (softmax - onehot) (0 for rows without target); dh = dlogits @ W
// (overwrite) and dw += dlogits^T @ h.
template <typename T>
void head_cross_entropy(const T* h, int64_t rows, int64_t dim, const T* w, int64_t vocab,
                        const int32_t* targets, int64_t chunk_rows, T* logits_ws, double grad_scale,
                        T* dh, T* dw, double* loss_sum, int64_t* count);

template <typename T>
void add_inplace(T* y, const T* x, int64_t n);  // y += x
template <typename T>
void scale_inplace(T* x, int64_t n, double s);
// Σ x², summed in fixed 4096-element blocks in order (independent of the thread count).
template <typename T>
double sum_squares(const T* x, int64_t n);

// Decoupled-weight-decay Adam on flat arrays (grad is multiplied by grad_scale first).
template <typename T>
void adamw_update(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int64_t step, double grad_scale);

}  // namespace sparsetron::cpu

namespace sparsetron::cpu {

// Sparse multi-query attention over selected keys (the absorbed MLA of SPEC §2-3): one key/value
// head shared by all query heads. q: [T, H, dqk]; kv: [T, dqk] with v = kv[:, :dv]; idx: [T, K]
// ascending key rows (-1 = unused) with len[t] valid entries; out: [T, H, dv]; lse: [H, T].
// Rows with no key get out = 0, lse = 0.
template <typename T>
void sparse_mqa_forward(int64_t tokens, int64_t heads, int64_t dqk, int64_t dv, const T* q,
                        const T* kv, const int32_t* idx, const int32_t* len, int64_t kslots,
                        double scale, T* out, T* lse);
// dq: [T, H, dqk] (overwritten); dkv: [keys, dqk] (overwritten; the value gradient is added into
// its first dv columns because v aliases them). dkv_heads: scratch [H, keys, dqk] (per-head
// partials, summed in head order so the result does not depend on threads). keys: rows of kv
// (0: tokens; context parallelism attends over more key rows than it has queries).
template <typename T>
void sparse_mqa_backward(int64_t tokens, int64_t heads, int64_t dqk, int64_t dv, const T* q,
                         const T* kv, const int32_t* idx, const int32_t* len, int64_t kslots,
                         double scale, const T* out, const T* lse, const T* dout, T* dq,
                         T* dkv_heads, T* dkv, int64_t keys = 0);

}  // namespace sparsetron::cpu

namespace sparsetron::cpu {

// LayerNorm with weight and bias per row: y = w * (x - mean) * rstd + b. mean/rstd: [rows].
template <typename T>
void layernorm_forward(const T* x, const T* w, const T* b, int64_t rows, int64_t dim, double eps,
                       T* y, T* mean, T* rstd);
// dx written; dw, db accumulate.
template <typename T>
void layernorm_backward(const T* dy, const T* x, const T* w, const T* mean, const T* rstd,
                        int64_t rows, int64_t dim, T* dx, T* dw, T* db);

}  // namespace sparsetron::cpu
