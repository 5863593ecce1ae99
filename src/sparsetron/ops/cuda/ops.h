// The CUDA backend's ops (DESIGN §3): one declaration per op, the same contract as the CPU
// reference in ops/cpu/kernels.h unless a line below says otherwise.
//
// Storage: activations and weights bf16, statistics (rstd, lse, losses), parameter gradients,
// router probabilities and optimizer state fp32; every reduction accumulates in fp32. Pointers are
// device pointers; every op is asynchronous on ctx.stream, allocates nothing and never reads
// device memory from the host, so a step made of them can be captured as a CUDA graph.
// Variable sizes (document bounds, per-expert counts, top-k lengths) are read from device memory.
#pragma once

#include <cstdint>
#include <string>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/ops/paged_stash.h"

namespace sparsetron::cuda {

// Whether the current device runs the sm_90a kernels (wgmma, TMA multicast): the architecture
// predicate of the dispatch functions.
bool has_sm90a();

// ---- GEMM (cuBLASLt) ---------------------------------------------------------------------------
// C[m,n] = alpha * op(A) @ op(B) + beta * C, row-major with leading dimensions, like cpu::gemm.
// A and B have `ab` type (BF16 or F32), C has `c_type` (BF16 or F32); fp32 accumulation.
// `batch` > 1 runs independent problems at the given element strides.
struct GemmBatch {
    int64_t count = 1, stride_a = 0, stride_b = 0, stride_c = 0;
    // fp32 inputs: let cuBLASLt use TF32 tensor cores (Muon's Newton-Schulz at
    // muon_fp32_matmul_prec "medium"/"high"; never for the router or the tests' fp32 references).
    // CUBLAS_COMPUTE_32F_FAST_16BF was tried for "medium": on the H200 it gave TF32's error and
    // time exactly (docs/perf/2026-11-30-muon-optimizer-share.md), so bf16 Newton-Schulz needs
    // explicit bf16 operands.
    bool tf32 = false;
};
void gemm(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          float alpha, const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c,
          int64_t ldc, DType ab = DType::BF16, DType c_type = DType::BF16, GemmBatch batch = {});
// The same out of place: d = alpha op(a) op(b) + beta c_in, c_in and d of one layout (ldc, c_type,
// batch.stride_c); c_in may be an operand (Newton-Schulz's W' = B W + a W without copying W).
void gemm_out(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
              float alpha, const void* a, int64_t lda, const void* b, int64_t ldb, float beta,
              const void* c_in, void* d, int64_t ldc, DType ab, DType c_type, GemmBatch batch = {});

// ---- Element-wise and small ops ----------------------------------------------------------------
// A negative id gives a zero row (an MTP input past its document's end).
void embedding_forward(const ExecContext& ctx, const int32_t* tokens, int64_t rows,
                       const bf16* table, int64_t dim, bf16* out);
// dtable += scattered dout rows, negative ids skipped (fp32 atomics: the order of additions is
// not fixed).
void embedding_backward(const ExecContext& ctx, const int32_t* tokens, int64_t rows,
                        const bf16* dout, int64_t dim, float* dtable);

void rmsnorm_forward(const ExecContext& ctx, const bf16* x, int64_t ldx, const bf16* w,
                     int64_t rows, int64_t dim, float eps, bf16* y, int64_t ldy, float* rstd);
// dw += Σ_rows (fp32, fixed-order partial sums in `ws` of rmsnorm_ws_floats(rows, dim) floats).
void rmsnorm_backward(const ExecContext& ctx, const bf16* dy, int64_t lddy, const bf16* x,
                      int64_t ldx, const bf16* w, const float* rstd, int64_t rows, int64_t dim,
                      bf16* dx, int64_t lddx, bool accumulate, float* dw, float* ws);
int64_t rmsnorm_ws_floats(int64_t rows, int64_t dim);

void layernorm_forward(const ExecContext& ctx, const bf16* x, const bf16* w, const bf16* b,
                       int64_t rows, int64_t dim, float eps, bf16* y, float* mean, float* rstd);
// dx written; dw, db accumulate (fp32). ws: 2 * rmsnorm_ws_floats(rows, dim) floats.
void layernorm_backward(const ExecContext& ctx, const bf16* dy, const bf16* x, const bf16* w,
                        const float* mean, const float* rstd, int64_t rows, int64_t dim, bf16* dx,
                        float* dw, float* db, float* ws);

// In place, like cpu::rope (angles in fp64, so positions up to 2^24 keep their phase).
void rope(const ExecContext& ctx, bf16* x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_t,
          int64_t ld_h, const int32_t* positions, double theta, bool interleaved, bool inverse);

void swiglu_forward(const ExecContext& ctx, const bf16* g, const bf16* u, int64_t n, bf16* out);
void swiglu_backward(const ExecContext& ctx, const bf16* g, const bf16* u, const bf16* dout,
                     int64_t n, bf16* dg, bf16* du);

// An FP8 copy written beside a bf16 output by the kernels that produce the routed experts' GEMM
// inputs: the 1x128 quantization of the bf16 rows as written (bit for bit quantize_fp8_1x128 of
// them), scales in the GEMM layout of `rows` rows (the buffer's row capacity). q == nullptr:
// none. Fused where the rows are whole 128-column blocks and 16-byte aligned; otherwise the bf16
// kernel then quantize_fp8_1x128 over the buffer (same bytes).
struct Fp8RowsOut {
    uint8_t* q = nullptr;
    float* scale_inv = nullptr;
    int64_t rows = 0;
    bool pow2 = true;
};
// The same over [rows, cols] with the FP8 copies of out (forward) and of dg and du (backward).
void swiglu_forward(const ExecContext& ctx, const bf16* g, const bf16* u, int64_t rows,
                    int64_t cols, bf16* out, const Fp8RowsOut& out8);
void swiglu_backward(const ExecContext& ctx, const bf16* g, const bf16* u, const bf16* dout,
                     int64_t rows, int64_t cols, bf16* dg, bf16* du, const Fp8RowsOut& dg8,
                     const Fp8RowsOut& du8);

void add_inplace(const ExecContext& ctx, bf16* y, const bf16* x, int64_t n);
void add_inplace(const ExecContext& ctx, float* y, const float* x, int64_t n);
void fill(const ExecContext& ctx, float* x, int64_t n, float value);

// ---- Gradient norm, clipping and AdamW with device scalars -----------------------------------
// Σ x² over `n` fp32 values in fixed blocks, written to partials[sum_squares_blocks(n)].
int64_t sum_squares_blocks(int64_t n);
void sum_squares_partials(const ExecContext& ctx, const float* x, int64_t n, float* partials);
// norm = sqrt(Σ partials) (fp64, fixed order); scale = max_norm / (norm + 1e-6) if
// 0 < max_norm < norm else 1; a non-finite norm gives scale 0 and sets *skip = 1 (the step is
// skipped).
void clip_scale(const ExecContext& ctx, const float* partials, int64_t count, float max_norm,
                float* norm, float* scale, int32_t* skip);
// skip[0..n) = OR of them all (one non-finite clipping group skips the whole step).
void merge_skip(const ExecContext& ctx, int32_t* skip, int64_t n);
// skip[0..n) |= (*flag != 0): an outside reason to skip the step (the MoE stash overflowed).
void veto_skip(const ExecContext& ctx, int32_t* skip, int64_t n, const int32_t* flag);
// param -= lr * (m̂ / (sqrt(v̂) + eps) + wd * param) with grad * (*grad_scale); nothing when *skip.
// Writes the bf16 copy of the new parameter when param_bf16 is not null. With `schedule` (device
// [lr, 1 - beta1^t, 1 - beta2^t]: graph-safe), lr and step come from there instead.
void adamw_update(const ExecContext& ctx, float* param, const float* grad, float* m, float* v,
                  int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                  int64_t step, const float* grad_scale, const int32_t* skip, bf16* param_bf16,
                  const float* schedule = nullptr);

// ---- Muon pieces ------------------------------------------------------------------------------
// Unless *skip: mom = beta mom + (1 - beta) g (*scale). (The decoupled decay is applied with the
// update: muon_apply_batch.)
void muon_momentum(const ExecContext& ctx, const float* g, float* mom, int64_t n, float beta,
                   const float* scale, const int32_t* skip);

// ---- Output head fused with cross-entropy ------------------------------------------------------
// Per chunk of rows: logits (fp32, logits_ws [chunk, vocab]) -> row_loss[r] (0 without target) and
// dlogits = grad_scale * (softmax - onehot) (bf16) -> dh (overwrite, bf16) and dw += (fp32). dh
// and dw may be null (forward only). dlogits_ws: [rows, vocab] when dw is given (dw is one GEMM
// over all rows), else [chunk_rows, vocab]. With `grad_scale_dev` (a device scalar: graph-safe)
// the scale is grad_scale * *grad_scale_dev. dw = dw_beta * dw + the gradient (0: overwrite).
void head_cross_entropy(const ExecContext& ctx, const bf16* h, int64_t rows, int64_t dim,
                        const bf16* w, int64_t vocab, const int32_t* targets, int64_t chunk_rows,
                        float* logits_ws, bf16* dlogits_ws, float grad_scale, float* row_loss,
                        bf16* dh, float* dw, const float* grad_scale_dev = nullptr,
                        float dw_beta = 1.f);
// out[0] = Σ x (fp64 in fixed order), out[1] = count of x's rows with targets >= 0.
void loss_sum(const ExecContext& ctx, const float* row_loss, const int32_t* targets, int64_t rows,
              double* out);

// ---- Attention ----------------------------------------------------------------------------------
// Document layout: row_begin[t] = first row of t's document, -1 for padding rows (no document).
void doc_row_begin(const ExecContext& ctx, const int32_t* cu_seqlens, const int32_t* num_docs,
                   int64_t tokens, int32_t* row_begin);

// Dense causal attention within documents (the expanded MLA path). Strides as cpu::AttnShape.
// out: [T, H, dv] bf16, lse: [H, T] fp32 (0 for padding rows).
struct AttnShape {
    int64_t tokens, heads, dqk, dv;
    int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh;
};
void attention_forward(const ExecContext& ctx, const AttnShape& s, const bf16* q, const bf16* k,
                       const bf16* v, const int32_t* row_begin, float scale, bf16* out, float* lse);
// dq: bf16 with q's strides (overwritten); dk [T, H, dqk], dv [T, H, dv]: fp32, contiguous,
// overwritten (zeroed, then accumulated with atomics).
void attention_backward(const ExecContext& ctx, const AttnShape& s, const bf16* q, const bf16* k,
                        const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                        const int32_t* row_begin, float scale, bf16* dq, float* dk, float* dv);

// Sparse MQA over selected keys (absorbed MLA), like cpu::sparse_mqa_forward. With prob_sum
// ([T, kslots] fp32), also writes Σ_h P[h, t, j] for each selected key j (0 past len[t]): the
// DSA indexer loss's teacher before normalization, so the loss needs no second pass over Q'K'.
// Two implementations: gathered keys (sparse_mqa_tc.cu, or the per-head reference kernels), and
// masked dense GEMMs through cuBLASLt (sparse_mqa_masked.cu), used when `workspace` is given:
// sparse_mqa_workspace_bytes() is the size the model plans, 0 where the gathered form is the
// faster one (the top-k a small share of the context: keys > 8 * kslots); a smaller workspace
// only means smaller chunks of query rows. key_rows: rows of kv (0: tokens, query row t being
// key row t; context parallelism has more key rows than queries, and every chunk of queries is
// scored against all of them, the top-k still selecting which count).
int64_t sparse_mqa_workspace_bytes(int64_t tokens, int64_t heads, int64_t kslots,
                                   int64_t key_rows = 0);
// Saved probabilities (masked form, key_rows 0 only): the bf16 elements of every chunk's P for a
// masked forward with this workspace (0 without one). Given to the forward as `saved_probs` it
// keeps them; given to the backward it skips recomputing the scores and P (one GEMM and one
// kernel per chunk) at the cost of this buffer per layer.
int64_t sparse_mqa_saved_probs_elems(int64_t tokens, int64_t heads, int64_t workspace_bytes);
void sparse_mqa_forward(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                        int64_t dv, const bf16* q, const bf16* kv, const int32_t* idx,
                        const int32_t* len, int64_t kslots, float scale, bf16* out, float* lse,
                        float* prob_sum = nullptr, void* workspace = nullptr,
                        int64_t workspace_bytes = 0, int64_t key_rows = 0,
                        bf16* saved_probs = nullptr);
// The flash-style wgmma forward (sm_90a, 64 heads, qk 576, v 512; no saved probabilities):
// sparse_mqa_forward's choice where it applies and no saved probabilities are asked for.
void sparse_mqa_forward_wgmma(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                              int64_t dv, const bf16* q, const bf16* kv, const int32_t* idx,
                              const int32_t* len, int64_t kslots, float scale, bf16* out,
                              float* lse, float* prob_sum = nullptr);
bool sparse_mqa_forward_wgmma_supported(int64_t heads, int64_t dqk, int64_t dv);
// The flash-style wgmma backward (same shapes; sparse_mqa_wgmma_bwd.cu): dq overwritten, dkv
// [max(tokens, key_rows), dqk] zeroed then accumulated by reductions. sparse_mqa_backward's choice
// in place of the gathered kernels (the masked form, where planned, is faster).
void sparse_mqa_backward_wgmma(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                               int64_t dv, const bf16* q, const bf16* kv, const int32_t* idx,
                               const int32_t* len, int64_t kslots, float scale, const bf16* out,
                               const float* lse, const bf16* dout, bf16* dq, float* dkv,
                               int64_t key_rows = 0);
// dq bf16 (overwritten); dkv fp32 [keys, dqk] (zeroed, then accumulated: atomics when gathered,
// chunk-ordered GEMM accumulation when masked). keys: rows of kv (0: tokens).
void sparse_mqa_backward(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                         int64_t dv, const bf16* q, const bf16* kv, const int32_t* idx,
                         const int32_t* len, int64_t kslots, float scale, const bf16* out,
                         const float* lse, const bf16* dout, bf16* dq, float* dkv,
                         void* workspace = nullptr, int64_t workspace_bytes = 0, int64_t keys = 0,
                         const bf16* saved_probs = nullptr);
// The same sparse attention in MLA's expanded form (per-head keys and values, the top-k shared by
// the heads), as masked dense GEMMs batched over the heads: the absorbed form's workspace
// (sparse_mqa_workspace_bytes without key rows), its saved probabilities and its P / dS kernels;
// scores over dqk and values of dv per head instead of the latent's L and kr (at the GLM-5 shape
// 256 + 256 against 576 + 512: 0.47x the GEMM FLOPs). q [T, H, dqk], out [T, H, dv], dq
// (overwritten) contiguous; head h's keys at k + t * k_row + h * k_head, values likewise.
// Backward: dk [T, H, dqk] and dv [T, H, dv] fp32, overwritten (chunks in reverse order: the last
// covers every key and writes, the others add; deterministic). Not for context parallelism.
struct HeadKV {
    const bf16* k;
    int64_t k_row, k_head;
    const bf16* v;
    int64_t v_row, v_head;
};
void sparse_mha_forward_masked(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                               int64_t dv, const bf16* q, const HeadKV& kv, const int32_t* idx,
                               const int32_t* len, int64_t kslots, float scale, bf16* out,
                               float* lse, float* prob_sum, void* workspace,
                               int64_t workspace_bytes, bf16* saved_probs = nullptr);
void sparse_mha_backward_masked(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                                int64_t dv, const bf16* q, const HeadKV& kv, const int32_t* idx,
                                const int32_t* len, int64_t kslots, float scale, const bf16* out,
                                const float* lse, const bf16* dout, bf16* dq, float* dk, float* dvv,
                                void* workspace, int64_t workspace_bytes,
                                const bf16* saved_probs = nullptr);

// ---- DSA indexer
// --------------------------------------------------------------------------------- scores[t, s] =
// Σ_j w[t, j] relu(q[t, j] · k[s]) for s in [row_begin[t], t]; other columns of a row are not
// written. q: [T, H, d] bf16, k: [T, d] bf16, w: [T, H] fp32, scores: [T, T] fp32.
// On sm_90 with a shape indexer_scores_wgmma_supported() takes, the fused wgmma kernel. Otherwise,
// with `workspace` (indexer_scores_workspace_bytes() is the planned size; a smaller one means
// smaller chunks), the dot products go through cuBLASLt in chunks of query rows; without, one
// simple kernel computes everything.
int64_t indexer_scores_workspace_bytes(int64_t tokens, int64_t heads);
// Context parallelism (key_row given, no workspace): query row t is micro-batch row key_row[t],
// k holds `keys` micro-batch rows and scores rows are `keys` long.
void indexer_scores(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                    const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                    float* scores, void* workspace = nullptr, int64_t workspace_bytes = 0,
                    const int32_t* key_row = nullptr, int64_t keys = 0);
// The forms indexer_scores chooses from, for the harness and tests: the cuBLASLt chunks (a
// workspace is required) and the fused wgmma kernel (sm_90; 16 / 32 / 64 heads, 64 / 128 dims;
// key_row as in indexer_scores).
void indexer_scores_gemm(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                         const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                         float* scores, void* workspace, int64_t workspace_bytes);
bool indexer_scores_wgmma_supported(int64_t heads, int64_t dim);
void indexer_scores_wgmma(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                          const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                          float* scores, const int32_t* key_row = nullptr, int64_t keys = 0);
// Per row: the min(kslots, t - begin + 1) largest scores of [begin, t], ties toward the smaller
// key index (deterministic), written ascending; -1 padding; len[t]. Padding rows: len 0.
// key_row (context parallelism): row t's keys are [begin, key_row[t]].
void topk_rows(const ExecContext& ctx, const float* scores, int64_t ld, const int32_t* row_begin,
               int64_t tokens, int64_t kslots, int32_t* idx, int32_t* len,
               const int32_t* key_row = nullptr);
// The top-k with the row in registers (topk_registers.cu; rows of at most 32768 keys): the same
// contract, the form topk_rows (topk_stream.cu) replaced; kept for the harness and the tests.
void topk_rows_registers(const ExecContext& ctx, const float* scores, int64_t ld,
                         const int32_t* row_begin, int64_t tokens, int64_t kslots, int32_t* idx,
                         int32_t* len, const int32_t* key_row = nullptr);

// ---- MoE
// ----------------------------------------------------------------------------------------- probs =
// sigmoid(logits) [T, E]; top-k of probs + bias (ties toward the smaller expert, or the forced
// round-robin choice); gates = scaling * p / Σ p over the chosen. Padding rows get -1.
void router_topk(const ExecContext& ctx, const float* logits, const float* bias,
                 const int32_t* row_begin, int64_t tokens, int64_t experts, int64_t k,
                 bool force_balance, float scaling, float* probs, int32_t* topk, float* gates);
// Expert-major permutation, token order within an expert, at most `capacity` rows per expert:
// counts[E] (routed, before capacity), offsets[E+1] (kept rows), slot_row [T*k] (-1 if dropped
// or padding), perm_token [T*k] (rows >= offsets[E] are left as they were).
void moe_permute(const ExecContext& ctx, const int32_t* topk, int64_t tokens, int64_t experts,
                 int64_t k, int64_t capacity, int32_t* counts, int32_t* offsets, int32_t* slot_row,
                 int32_t* perm_token);
// out[r] = x[perm_token[r]] for r < offsets[E].
// out8: the FP8 copy of the gathered rows (Fp8RowsOut above; rows past offsets[E] unwritten).
void moe_gather(const ExecContext& ctx, const bf16* x, const int32_t* perm_token,
                const int32_t* offsets, int64_t experts, int64_t rows, int64_t dim, bf16* out,
                const Fp8RowsOut& out8 = {});
// y[t] += Σ_j gates[t, j] * out_perm[slot_row[t, j]].
void moe_combine(const ExecContext& ctx, const bf16* out_perm, const int32_t* slot_row,
                 const float* gates, int64_t tokens, int64_t k, int64_t dim, bf16* y);

// Grouped GEMM over the permuted layout, expert e owning rows [offsets[e], offsets[e+1]):
//   RowsTimesWeightT: C[r, :] = A[r, :] @ W_e^T      A [R, K], W [E, N, K], C [R, N] bf16
//   RowsTimesWeight:  C[r, :] = A[r, :] @ W_e        A [R, N], W [E, N, K], C [R, K] bf16
//   WeightGrad:       dW_e (+)= A_e^T @ B_e          A [R, N], B [R, K], dW [E, N, K] fp32
// max_rows bounds any expert's row count (the capacity); counts are read from device memory.
// row_capacity: the rows the row operands' buffers hold (A, and B for WeightGrad; offsets[E] <=
// row_capacity): the bound of the kernels' bulk tensor loads, which read whole tiles past an
// expert's last row (never past the buffer).
enum class GroupedGemm { RowsTimesWeightT, RowsTimesWeight, WeightGrad };
// `weight_stride`: elements between consecutive experts' weights (0 = n * k, packed). With
// `accumulate` the outputs are added to; without, they are written, and WeightGrad writes every
// expert's dW (zeros for an expert with no rows), so a step's first weight gradient needs no
// memset of the gradient before it and its tiles are not read.
void grouped_gemm(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets, int64_t experts,
                  int64_t max_rows, int64_t row_capacity, int64_t n, int64_t k, const bf16* a,
                  const bf16* b, void* c, int64_t weight_stride = 0, bool accumulate = false);

// Backward of moe_combine: dout_perm[slot] = gate * dy[t] (rows without a slot untouched) and
// dgates[t, j] = dy[t] · out_perm[slot] (0 when not routed).
// dout8: the FP8 copy of dout_perm's written rows (Fp8RowsOut above).
void moe_combine_backward(const ExecContext& ctx, const bf16* dy, const bf16* out_perm,
                          const int32_t* slot_row, const float* gates, int64_t tokens, int64_t k,
                          int64_t dim, bf16* dout_perm, float* dgates,
                          const Fp8RowsOut& dout8 = {});
// Backward of moe_gather: dx[t] (+)= Σ_j dx_perm[slot_row[t, j]] in j order (deterministic).
void moe_gather_backward(const ExecContext& ctx, const bf16* dx_perm, const int32_t* slot_row,
                         int64_t tokens, int64_t k, int64_t dim, bf16* dx, bool accumulate);
// dlogits [T, E] (fp32) from the gate gradients: gates = scaling * s_c / Σ s_chosen, s =
// sigmoid(logits). Unrouted rows and unchosen experts get 0.
void router_backward(const ExecContext& ctx, const float* probs, const int32_t* topk,
                     const float* dgates, int64_t tokens, int64_t experts, int64_t k, float scaling,
                     float* dlogits);
// load[e] += counts[e]; dropped[0] += Σ max(0, counts[e] - capacity).
void moe_count_load(const ExecContext& ctx, const int32_t* counts, int64_t experts,
                    int64_t capacity, int64_t* load, int64_t* dropped);
// Aux-loss-free balancing: bias[e] += rate * sign(mean(load) - load[e]).
void moe_update_bias(const ExecContext& ctx, const int64_t* load, int64_t experts, float rate,
                     float* bias);

// ---- Paged stash (ops/paged_stash.h: state words, page tables, the CPU reference) -----------
// Every page of the pool free; with new_step the statistics and the overflow flag cleared too.
void stash_reset(const ExecContext& ctx, int32_t* state, int32_t* free_list, int64_t pages,
                 bool new_step);
// Rows 0 .. *rows_ptr - 1 of `src` into freshly taken pages of the pool (`pages` pages of
// page_rows x src.row_width() bf16); `table` has 1 + ceil(max_rows / page_rows) words and
// *rows_ptr <= max_rows (a larger count is treated as an overflow).
void stash_push(const ExecContext& ctx, int32_t* state, int32_t* free_list, int64_t pages,
                int32_t* table, int64_t max_rows, const int32_t* rows_ptr, int64_t page_rows,
                const StashRows& src, bf16* pool);
// The rows of the push recorded in `table` back into `dst`, then its pages back to the free list.
void stash_pop(const ExecContext& ctx, int32_t* state, int32_t* free_list, const int32_t* table,
               int64_t max_rows, const int32_t* rows_ptr, int64_t page_rows, const StashRows& dst,
               const bf16* pool);

// ---- Copies and conversions
// ---------------------------------------------------------------------- rows x width_bytes from
// src (pitch in bytes) to dst (pitch in bytes), on the stream.
void copy_2d(const ExecContext& ctx, void* dst, int64_t dst_pitch, const void* src,
             int64_t src_pitch, int64_t width_bytes, int64_t rows);
void zero(const ExecContext& ctx, void* dst, int64_t bytes);
// Host -> device on the stream (the host buffer may be reused when this returns) and device ->
// host followed by a stream synchronization.
void upload(const ExecContext& ctx, void* dst, const void* src, int64_t bytes);
void download(const ExecContext& ctx, void* dst, const void* src, int64_t bytes);
// dst[r, c] (+)= src[r, c] for a rows x cols block with leading dimensions, fp32 -> bf16.
void f32_to_bf16_2d(const ExecContext& ctx, const float* src, int64_t ld_src, bf16* dst,
                    int64_t ld_dst, int64_t rows, int64_t cols, bool accumulate);
void bf16_to_f32(const ExecContext& ctx, const bf16* src, float* dst, int64_t n);
void f32_to_bf16(const ExecContext& ctx, const float* src, bf16* dst, int64_t n);

// ---- FP8 blockwise quantization (fp8_quantize.cu; bit for bit the CPU reference,
// ops/cpu/fp8_blockwise.h): e4m3 q and fp32 scale_inv (x ~ q * scale_inv), the scales in the
// GEMM's layout (ops/fp8_scale_layout.h: fp8::scales_1x128 / scales_128x128 floats).
// Activations x [rows, cols] bf16 (row stride ld), one scale per 1x128 block of a row.
void quantize_fp8_1x128(const ExecContext& ctx, const bf16* x, int64_t rows, int64_t cols,
                        int64_t ld, bool pow2, uint8_t* q, float* scale_inv);
// Weights w [rows, cols] fp32 (the masters: quantized from full precision), 128x128 blocks.
// `transposed`: q and scale_inv are those of w^T [cols, rows] (the input-gradient GEMM's operand;
// bit for bit the quantization of w^T).
void quantize_fp8_128x128(const ExecContext& ctx, const float* w, int64_t rows, int64_t cols,
                          bool pow2, uint8_t* q, float* scale_inv, bool transposed = false);
// Both at once (one read of w): q, scale_inv as the plain call, qt, scale_inv_t as transposed.
// With `count` > 1: `count` matrices, w's `w_stride` elements apart (a layer's experts: one
// parameter stride apart in the masters), their outputs packed matrix after matrix (q and qt
// rows x cols apart, the scales fp8::scales_128x128 of their shapes apart), in one launch.
void quantize_fp8_128x128_both(const ExecContext& ctx, const float* w, int64_t rows, int64_t cols,
                               bool pow2, uint8_t* q, float* scale_inv, uint8_t* qt,
                               float* scale_inv_t, int64_t count = 1, int64_t w_stride = 0);
// 1x128 blocks down the columns of x [rows, cols] bf16 (row stride ld), written as the operand
// x^T [cols, rows] (rows contiguous) with its 1x128 scales: the weight gradient's operands, whose
// contraction runs over rows (tokens). Bit for bit quantize_fp8_1x128 of x^T.
void quantize_fp8_1x128_columns(const ExecContext& ctx, const bf16* x, int64_t rows, int64_t cols,
                                int64_t ld, bool pow2, uint8_t* q, float* scale_inv);

// ---- FP8 block-scaled GEMM (gemm_fp8.cu, cuBLASLt on Hopper): y [m, n] bf16 (row stride
// ldy) = x [m, k] w [n, k]^T (+ y when accumulate), both e4m3 with k contiguous and their scales
// in the GEMM layout; x has 1x128 scales, w 1x128 or 128x128 (not both 128x128: cuBLASLt
// rejects 2D x 2D). k and ldy multiples of 16. Products in fp32 with the scales applied per
// 128-wide block of k (no fast accumulation).
struct Fp8Operand {
    const uint8_t* q = nullptr;
    const float* scale_inv = nullptr;
    bool blocks_128x128 = false;  // false: 1x128
};
void gemm_fp8_blockwise(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, Fp8Operand x,
                        Fp8Operand w, bf16* y, int64_t ldy, bool accumulate = false);
// The same with an fp32 y (weight gradients accumulated into the fp32 gradient).
void gemm_fp8_blockwise(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, Fp8Operand x,
                        Fp8Operand w, float* y, int64_t ldy, bool accumulate = false);
// The routed experts' FP8 GEMM (grouped_gemm_fp8.cu, sm_90a wgmma): grouped_gemm's
// RowsTimesWeightT for e4m3 operands. For every expert e with rows [offsets[e], offsets[e+1]):
// y[rows] (+)= x[rows] W_e^T; x [row_capacity, k] with 1x128 scales (the GEMM layout of
// row_capacity rows), W [experts][n][k] packed with 128x128 scales per expert
// (fp8::scales_128x128(n, k) floats apart). Products in fp32, scaled per 128-deep block of k, y
// rounded to bf16. k a multiple of 16, n of 8. The input gradient is the same call on the W^T
// copies. `blocks` > 0 caps the persistent grid (tests: every block walks many tiles).
void grouped_gemm_fp8(const ExecContext& ctx, const int32_t* offsets, int64_t experts,
                      int64_t max_rows, int64_t row_capacity, int64_t n, int64_t k, Fp8Operand x,
                      Fp8Operand w, bf16* y, bool accumulate = false, int blocks = 0);
// Whether this GPU runs it (sm_90a); grouped_gemm_fp8 fails clearly where not.
bool grouped_gemm_fp8_available();

// ---- Context parallelism (cp_rows.cu): key_row[i] is row i's micro-batch row (-1: padding).
// dst [keys, dim] fp32 <- zero, then row key_row[i] = src[i] (the contribution to an all-reduce).
void rows_to_keys(const ExecContext& ctx, const bf16* src, int64_t rows, int64_t dim,
                  const int32_t* key_row, float* dst, int64_t keys);
// dst [rows, dim] <- src[key_row[i]] (0 for padding): this rank's rows of all-reduced key grads.
void keys_to_rows(const ExecContext& ctx, const float* src, int64_t dim, const int32_t* key_row,
                  int64_t rows, float* dst);
// dst [rows, dim] <- src[key_row[i] + shift] where that is a row of src ([keys, dim]), else 0.
void gather_key_rows(const ExecContext& ctx, const bf16* src, int64_t keys, int64_t dim,
                     const int32_t* key_row, int64_t shift, int64_t rows, bf16* dst);

// ---- MLA helpers
// ---------------------------------------------------------------------------------
// Expanded-attention keys from the kv_b output [T, H, dn + dvh] and the shared RoPE key (row t at
// pe + t * ld_pe): k[t, h, :dn] = kv[t, h, :dn], k[t, h, dn:] = pe[t, :dr]. One launch for all
// heads (the shared key broadcast to every head).
void mla_expanded_keys(const ExecContext& ctx, const bf16* kv, const bf16* pe, int64_t ld_pe,
                       int64_t tokens, int64_t heads, int64_t dn, int64_t dr, int64_t dvh, bf16* k);
// Expanded-attention key/value gradients back to the kv_b output and the shared RoPE key:
// dkv[t, h*(dn+dv) + i] = dk[t, h, i] (i < dn), dkv[t, h*(dn+dv) + dn + i] = dv[t, h, i];
// dpe[t * ld_pe + i] = Σ_h dk[t, h, dn + i].
void mla_expanded_kv_grad(const ExecContext& ctx, const float* dk, const float* dv, int64_t tokens,
                          int64_t heads, int64_t dn, int64_t dr, int64_t dvh, bf16* dkv, bf16* dpe,
                          int64_t ld_pe);

// ---- DSA indexer loss
// ------------------------------------------------------------------------------ Per row t with
// support S_t (sparse: idx[t, :len[t]]; dense: row_begin[t]..t):
//   teacher p = normalize(Σ_h softmax-probabilities of the attention, exp(scale q'_h·k'_s - lse_h))
//   (sparse: the attention's own lse [H, T]; dense: recomputed over S_t),
//   student log q = log_softmax(scores[t, S_t]); kl[t] = Σ p (log p - log q);
//   dscore[t, s] = q_s - p_s on the support (dense layout [T, T] like the scores).
// qabs [T, H, dl] and kabs [T, dl] are the absorbed query and latent key (bf16).
// teacher_sum (sparse loss only, may be null): the attention's Σ_h P [T, kslots] from
// sparse_mqa_forward; when given, qabs/kabs/lse are not read.
void indexer_kl(const ExecContext& ctx, bool sparse, const bf16* qabs, const bf16* kabs,
                const float* lse, int64_t heads, int64_t dl, float scale, const float* scores,
                const int32_t* idx, const int32_t* len, int64_t kslots, const int32_t* row_begin,
                int64_t tokens, float* kl, float* dscore, const float* teacher_sum = nullptr,
                const int32_t* key_row = nullptr, int64_t keys = 0);
// Back through the scores: with g = dscore * grad_scale on the support,
//   dw[t, j] = Σ_s g relu'(.) (q_tj·k_s), dq[t, j] = Σ_s g w[t, j] 1[q·k > 0] k_s (bf16),
//   dk[s] += Σ_t g w[t, j] 1[q·k > 0] q_tj (fp32, zeroed first).
void indexer_scores_backward(const ExecContext& ctx, bool sparse, const bf16* q, const bf16* k,
                             const float* w, const float* dscore, float grad_scale,
                             const int32_t* idx, const int32_t* len, int64_t kslots,
                             const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                             float* dw, bf16* dq, float* dk,
                             const float* grad_scale_dev = nullptr,  // multiplies grad_scale
                             const int32_t* key_row = nullptr, int64_t keys = 0,  // dk: [keys]
                             void* workspace = nullptr, int64_t workspace_bytes = 0);
// With a workspace (and no key_row) the backward runs as GEMMs over chunks of query tokens: the
// per-head logits Q K^T (fp32) against every earlier key, one kernel forming their gradient
// (bf16, 0 off the support) and dw, then dq = dD K and dk += dD^T Q by cuBLASLt (deterministic).
// Otherwise a kernel per query row with atomics. Bytes of workspace per query token of a chunk:
int64_t indexer_scores_backward_bytes_per_token(int64_t tokens, int64_t heads);
// Σ kl over rows with len > 0 and the number of those rows: out[0] += Σ, out[1] += count.
void indexer_kl_sum(const ExecContext& ctx, const float* kl, const int32_t* len, int64_t tokens,
                    double* out);

// ---- MTP end-to-end TV
// ------------------------------------------------------------------------------ In place: rows of
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
