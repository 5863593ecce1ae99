// Losses: the output head fused with cross-entropy over row chunks, the loss sums, and the MTP
// end-to-end TV loss's pieces (SPEC §5). CPU reference: head_loss_cpu.cpp, mtp_tv_cpu.cpp; CUDA:
// head_loss.cu, mtp_tv.cu. Tests:
// tests/ops/test_loss.cpp, tests/gpu/ops/test_loss_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace sparsetron::cpu {

// Output head fused with cross-entropy over row chunks: for each chunk, logits = h @ W^T in
// `logits_ws` [chunk_rows, vocab]; loss_sum += Σ CE over rows with target >= 0. With dh/dw:
// dlogits = grad_scale * (softmax - onehot) (0 for rows without target); dh = dlogits @ W
// (overwrite) and dw += dlogits^T @ h.
template <typename T>
void head_cross_entropy(const T* h, int64_t rows, int64_t dim, const T* w, int64_t vocab,
                        const int32_t* targets, int64_t chunk_rows, T* logits_ws, double grad_scale,
                        T* dh, T* dw, double* loss_sum, int64_t* count);

// The MTP end-to-end TV loss (SPEC §5) on rows of draft and target distributions.
// In place: rows of z [rows, vocab] become softmax(z) (fp64 sums).
template <typename T>
void softmax_rows(T* z, int64_t rows, int64_t vocab);
// alpha[r] = Σ_v min(p[r, v], q[r, v]): 1 - TV of target p and draft q.
template <typename T>
void tv_overlap(const T* p, const T* q, int64_t rows, int64_t vocab, T* alpha);
// One chain row from its depths' α (alpha[k * stride], k < depths): loss = (1/D) Σ_j (1 - Π_{k<=j}
// α_k), accept = Σ_j Π_{k<=j} α_k; with dalpha, dalpha[k] = row_weight * ∂loss/∂α_k.
struct TvChainRow {
    double loss = 0, accept = 0;
};
template <typename T>
TvChainRow tv_chain_row(const T* alpha, int64_t stride, int64_t depths, double row_weight,
                        double* dalpha);
// In place of a draft row q (with its target row p): dz = -dalpha q (s - 1 + 1[q > p]) with s =
// Σ_{q<=p} q, the loss's gradient with respect to the draft logits.
template <typename T>
void tv_logit_grad_row(const T* p, T* q, int64_t vocab, double dalpha);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// Per chunk of rows: logits (fp32, logits_ws [chunk, vocab]) -> row_loss[r] (0 without target) and
// dlogits = grad_scale * (softmax - onehot) (bf16) -> dh (overwrite, bf16) and dw += (fp32). dh
// and dw may be null (forward only). dlogits_ws: [dlogits_rows, vocab], a multiple of chunk_rows
// (or all rows): with dw, the chunks' dlogits fill it and dw takes one GEMM per fill, so a
// longer workspace means fewer passes over the fp32 [vocab, dim] gradient and a bounded one
// keeps the memory linear in the chunk, not in the rows. With `grad_scale_dev` (a device scalar:
// graph-safe) the scale is grad_scale * *grad_scale_dev. dw = dw_beta * dw + the gradient (0:
// overwrite).
// The head's three GEMMs in FP8 blockwise (fp8_output_proj, the fp8_recipe's scaling): logits
// = h W^T (h 1x128 along dim, W 128x128), dh = dlogits W (dlogits 1x128 along the vocabulary,
// W^T 128x128), dw += dlogits^T h (both 1x128 along the rows), products summed in fp32. The
// operands are quantized into `a` and `b` (HeadFp8Scratch's sizes); dim and vocab multiples of
// 16, chunk_rows and rows of 16.
struct HeadFp8 {
    Fp8Operand w, wt;  // W [vocab, dim] and W^T [dim, vocab], 128x128 scales
    uint8_t *qa = nullptr, *qb = nullptr;
    float *sa = nullptr, *sb = nullptr;
};
struct HeadFp8Scratch {
    int64_t qa = 0, qb = 0, sa = 0, sb = 0;  // bytes of qa and qb, floats of sa and sb
};
HeadFp8Scratch head_fp8_scratch(int64_t chunk_rows, int64_t dlogits_rows, int64_t dim,
                                int64_t vocab);

struct HeadLoss {
    const bf16* h = nullptr;  // [rows, dim]
    int64_t rows = 0, dim = 0;
    const bf16* w = nullptr;  // [vocab, dim]
    int64_t vocab = 0;
    const int32_t* targets = nullptr;  // [rows], -1: no target
    int64_t chunk_rows = 0;
    float* logits_ws = nullptr;
    bf16* dlogits_ws = nullptr;
    int64_t dlogits_rows = 0;
    float grad_scale = 1.f;
    const float* grad_scale_dev = nullptr;
    float dw_beta = 1.f;
    DType dw_type = DType::F32;    // the weight gradient's: F32, or BF16 (a bf16 gradient buffer)
    const HeadFp8* fp8 = nullptr;  // the GEMMs in FP8 (then `w` is not read), or bf16
};
void head_cross_entropy(const ExecContext& ctx, const HeadLoss& p, float* row_loss, bf16* dh,
                        void* dw);
// Rows of the head's dlogits workspace the model plans: the hidden size rounded up to whole
// chunks (bf16 [dim, vocab] is half the fp32 [vocab, dim] gradient a pass reads and writes, so
// the passes past the first cost little next to the GEMMs), all rows when fewer.
int64_t head_dlogits_rows(int64_t rows, int64_t chunk_rows, int64_t dim);
// out[0] = Σ x (fp64 in fixed order), out[1] = count of x's rows with targets >= 0.
void loss_sum(const ExecContext& ctx, const float* row_loss, const int32_t* targets, int64_t rows,
              double* out);

// z [rows, V] (fp32) become softmax(z).
void softmax_rows(const ExecContext& ctx, float* z, int64_t rows, int64_t vocab);
// Rows of q (draft logits, fp32) become softmax(q) in place; with p the target probabilities,
// alpha[r] = Σ_v min(p[r, v], q[r, v]) and below[r] = Σ_{v: q<=p} q[r, v] (tv_logit_grad's sum).
void tv_draft_softmax_overlap(const ExecContext& ctx, const float* p, float* q, int64_t rows,
                              int64_t vocab, float* alpha, float* below);
// Per chain row i (valid[i] != 0): loss += (1/D) Σ_j (1 - Π_{k<=j} α_k), accept += Σ_j Π α;
// dalpha[k, i] = row_weight * ∂L/∂α_k (0 for invalid rows). alpha, dalpha: [D, T].
// Depth k's values of row i are at [k * stride + i]; sums[0] += loss, sums[1] += accept.
// With `row_weight_dev` (device scalar), the weight is row_weight * *row_weight_dev.
void tv_chain(const ExecContext& ctx, const float* alpha, const uint8_t* valid, int64_t depths,
              int64_t rows, int64_t stride, float row_weight, float* dalpha, double* sums,
              const float* row_weight_dev = nullptr);
// dz = -dalpha * q (s - 1 + 1[q > p]) with s = below[r] = Σ_{q<=p} q (from
// tv_draft_softmax_overlap), stored as bf16 into dz_out [rows, V].
void tv_logit_grad(const ExecContext& ctx, const float* p, const float* q, const float* dalpha,
                   const float* below, int64_t rows, int64_t vocab, bf16* dz_out);

}  // namespace sparsetron::cuda
