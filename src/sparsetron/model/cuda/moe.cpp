#include "sparsetron/model/cuda/moe.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <string>

#include "sparsetron/model/cuda/fp8_linear.h"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/ops/moe/sequence_aux.h"

namespace sparsetron::cuda {

using cuda::gemm;

namespace {
// Power-of-two scales for the expert rows, as Fp8Weights' (Transformer Engine's default).
}  // namespace

CudaMoeLayer::CudaMoeLayer(const ModelConfig& c, const CudaParams& P, CudaBuffers& B,
                           const std::string& p, int64_t tokens, int64_t max_docs,
                           const MoeStash* stash, Fp8Weights* fp8)
    : c_(c),
      P_(P),
      stash_(stash),
      T_(tokens),
      h_(c.hidden_size),
      E_(c.num_experts),
      k_(c.moe_router_topk),
      F_(c.moe_ffn_hidden_size),
      Fs_(c.moe_shared_expert_intermediate_size),
      act_(c.activation()),
      recompute_act_(act_.recomputes(RecomputeModule::MoeAct)) {
    capacity_ = c.moe_expert_capacity(tokens);
    router_ = P.index(p + "gate.weight");
    P.read_master(router_, /*by_gemm=*/true);  // the router's GEMM runs in fp32
    bias_ = P.index(p + "gate.e_score_correction_bias");
    // This rank's experts (all of them without expert parallelism: the weights are sharded).
    El_ = c.local_experts();
    const int64_t e0 = c.first_local_expert();
    gate0_ = P.index(cat(p, "experts.", e0, ".gate_proj.weight"));
    up0_ = P.index(cat(p, "experts.", e0, ".up_proj.weight"));
    down0_ = P.index(cat(p, "experts.", e0, ".down_proj.weight"));
    wstride_ = El_ > 1 ? P.index(cat(p, "experts.", e0 + 1, ".gate_proj.weight")) - gate0_ : 0;
    if (Fs_ > 0)
        shared_ = std::make_unique<CudaSwiGluMlp>(
            P, B, p + "shared_experts.", h_, Fs_, tokens, "moe.shared",
            act_.recomputes(RecomputeModule::SharedExperts), fp8, c.recompute_block_rows);
    const int64_t R = tokens * k_;
    // Expert parallelism: this rank's experts may receive every rank's rows (worst case).
    W_ = c.expert_parallel_ranks;
    ST_CHECK(E_ % W_ == 0, "CUDA MoE: ", E_, " experts over ", W_, " expert-parallel ranks");
    rows_ = W_ == 1 ? R : c.moe_ep_received_rows(tokens);
    chunk_tokens_ = W_ == 1 ? tokens : c.moe_ep_redo_chunk_tokens(tokens);
    // Row buffers share storage where one is dead before the other is written. `moe.rows`
    // (tokens x top-k rows of the hidden size) holds in turn, without expert parallelism: in the
    // forward the gathered input rows (dead after the gate and up GEMMs) and then the expert
    // outputs (dead after the combine); in the backward the output gradients (read last by the
    // down projection's weight gradient), the input gradients (read last by the gather's
    // backward) and the gathered input rows again (for the gate and up weight gradients). The
    // SwiGLU backward reads each element of the activation's gradient before writing the gate's
    // in its place.
    B.scratch(doutperm_, "moe.rows", {R, h_});
    B.scratch(dact_, "grad.moe.act_then_gate", {rows_, F_});
    // With moe_act recomputed (no stash, no expert parallelism) the up projection's gradient
    // takes the recomputed SwiGLU output's buffer: the down projection's gradients read the
    // output last, and the SwiGLU backward reads only the gate and up rows.
    if (W_ == 1 && !stash_ && recompute_act_)
        B.scratch(du_, "moe.recomputed.expert_act", {R, F_});
    else
        B.scratch(du_, "grad.moe.up", {rows_, F_});
    // The router's fp32 input a block of rows at a time.
    Br_ = std::min(tokens, c.recompute_block_rows);
    if (W_ > 1) {
        B.scratch(dout_owner_, "grad.moe.ep.out", {rows_, h_});
    }
    // Under fp8_recipe: blockwise the routed experts' forward and input-gradient GEMMs run FP8 as
    // the dense linears do; the kernels that produce their inputs write the FP8 copies.
    if (fp8) {
        fp8_ = fp8;
        for (int i = 0; i < 3; ++i)
            fp8_experts_[i] =
                fp8->add_experts(std::array{gate0_, up0_, down0_}[size_t(i)], wstride_, El_);
        const int64_t wide = std::max(h_, F_);
        B.scratch(fp8_rows_[0], "fp8.moe.rows", {rows_ * wide});
        B.scratch(fp8_row_scales_[0], "fp8.moe.row_scales",
                  {std::max(fp8::scales_1x128(rows_, h_), fp8::scales_1x128(rows_, F_))});
        B.scratch(fp8_rows_[1], "fp8.moe.rows_up_grad", {rows_ * F_});
        B.scratch(fp8_row_scales_[1], "fp8.moe.row_scales_up_grad", {fp8::scales_1x128(rows_, F_)});
    }
    B.scratch(dgates_, "grad.moe.gates", {tokens, k_});
    aux_ = c.moe_aux_loss_coeff > 0, docs_ = max_docs;
    if (aux_) {
        B.scratch(aux_work_, "moe.aux.work", {cuda::sequence_balance_work(docs_, E_)});
        B.scratch(aux_counts_, "moe.aux.counts", {docs_, E_});
        B.scratch(aux_psum_, "moe.aux.psum", {docs_, E_});
    }
    B.scratch(dlogits_, "grad.moe.router_logits", {tokens, E_});
    B.scratch(dlogits_bf_, "grad.moe.router_logits_bf16", {tokens, E_});
    // Routing statistics of this layer (device; read when metrics are logged).
    B.act(load_, p + "stats.load", {E_});
    B.act(dropped_, p + "stats.dropped", {1});
}

void CudaMoeLayer::declare(Acts& A, CudaBuffers& B, const std::string& p) const {
    const int64_t Tn = T_, R = T_ * k_;
    A = Acts{};
    // The router's fp32 input is the exact widening of the bf16 one: the backward makes it
    // again, so every application shares one buffer, of one block of rows.
    B.scratch(A.m32, "moe.router_input_f32", {Br_, h_});
    B.act(A.logits, p + "router_logits", {Tn, E_});
    B.act(A.probs, p + "router_probs", {Tn, E_});
    B.act(A.gates, p + "router_gates", {Tn, k_});
    B.act(A.topk, p + "router_topk", {Tn, k_});
    B.act(A.counts, p + "expert_counts", {E_});
    B.act(A.offsets, p + "expert_offsets", {E_ + 1});
    B.act(A.slot_row, p + "slot_row", {R});
    B.act(A.perm_token, p + "perm_token", {R});
    if (aux_) B.act(A.aux_f, p + "aux_f", {docs_, E_});
    // The routed experts' rows (expert_fc1: their gate / up outputs; moe_act: the SwiGLU output;
    // under expert parallelism their output rows too, with fused_group_mlp), kept, recomputed or
    // offloaded. Without expert parallelism the gathered input rows are not kept (the backward
    // gathers them again from the layer's input: the same copy) and neither are the output rows
    // (the backward takes the gate gradients from the down projection's input gradient and the
    // SwiGLU output instead): both live in `moe.rows` (the constructor).
    using S = CudaBuffers::Saving;
    const S fc1 = saving(act_, std::nullopt, OffloadModule::ExpertFc1),
            act = saving(act_, RecomputeModule::MoeAct, OffloadModule::MoeAct),
            out = saving(act_, std::nullopt, OffloadModule::ExpertOut);
    if (W_ > 1) {
        // The expert side holds received rows (owner layout); out_perm the results returned to
        // this rank's layout. With the paged stash the received input and the gate / up outputs
        // are working rows every application shares, their received rows kept in pages.
        B.act(A.ep_offsets, p + "ep_offsets", {W_, E_ + 1});
        B.act(A.recv_offsets, p + "ep_recv_offsets", {E_ / W_ + 1});
        if (stash_) {
            B.scratch(A.xperm, "moe.work.x_received", {rows_, h_});
            B.scratch(A.g, "moe.work.expert_gate", {rows_, F_});
            B.scratch(A.u, "moe.work.expert_up", {rows_, F_});
            B.scratch(A.act, "moe.work.expert_act", {rows_, F_});
            B.saved(out, A.out_perm, p + "expert_out", "", {R, h_});
            stash_->declare_table(A.stash_table, B, p);
            if (shared_) shared_->declare(A.shared, B, p + "shared_");
            return;
        }
        B.saved(fc1, A.xperm, p + "x_received", "", {rows_, h_});
        B.saved(fc1, A.g, p + "expert_gate", "", {rows_, F_});
        B.saved(fc1, A.u, p + "expert_up", "", {rows_, F_});
        B.saved(act, A.act, p + "expert_act", "moe.recomputed.expert_act_received", {rows_, F_});
        B.saved(out, A.out_perm, p + "expert_out", "", {R, h_});
    } else if (stash_) {
        // Every application shares the working rows; the kept ones go to the stash's pages.
        B.scratch(A.xperm, "moe.rows", {R, h_});
        B.scratch(A.g, "moe.work.expert_gate", {R, F_});
        B.scratch(A.u, "moe.work.expert_up", {R, F_});
        B.scratch(A.act, "moe.work.expert_act", {R, F_});
        B.scratch(A.out_perm, "moe.rows", {R, h_});
        stash_->declare_table(A.stash_table, B, p);
    } else {
        B.scratch(A.xperm, "moe.rows", {R, h_});
        B.saved(fc1, A.g, p + "expert_gate", "", {R, F_});
        B.saved(fc1, A.u, p + "expert_up", "", {R, F_});
        B.saved(act, A.act, p + "expert_act", "moe.recomputed.expert_act", {R, F_});
        B.scratch(A.out_perm, "moe.rows", {R, h_});
    }
    if (shared_) shared_->declare(A.shared, B, p + "shared_");
}

StashRows CudaMoeLayer::stashed(const Acts& A) const {
    StashRows s;
    s.count = 2;
    s.data[0] = A.g, s.width[0] = F_;
    s.data[1] = A.u, s.width[1] = F_;
    if (W_ > 1) {
        // The received input rows too: the backward cannot gather them again without an
        // exchange.
        s.count = 3;
        s.data[2] = A.xperm, s.width[2] = h_;
    }
    return s;
}

const int32_t* CudaMoeLayer::stashed_rows(const Acts& A) const {
    return W_ > 1 ? A.recv_offsets + El_ : A.offsets + E_;
}

void CudaMoeLayer::forward(const ExecContext& ctx, const Acts& A, const bf16* m,
                           const CudaInputs& in, bf16* y) const {
    const int64_t Tn = T_, R = T_ * k_;
    for (int64_t r0 = 0; r0 < Tn; r0 += Br_) {
        const int64_t n = std::min(Br_, Tn - r0);
        cuda::bf16_to_f32(ctx, m + r0 * h_, A.m32, n * h_);
        gemm(ctx, false, true, n, E_, h_, 1.f, A.m32, h_, P_[router_].master, h_, 0.f,
             A.logits + r0 * E_, E_, F32, F32);
    }
    cuda::router_topk(ctx, A.logits, P_[bias_].master, in.row_begin, Tn, E_, k_,
                      c_.moe_router_force_load_balancing, float(c_.moe_router_topk_scaling_factor),
                      A.probs, A.topk, A.gates);
    if (aux_) {
        ST_ASSERT(in.docs <= docs_, "CUDA MoE: ", in.docs, " documents, planned for ", docs_);
        // The sequence aux loss: each document's choices summed over the CP group; its value
        // added once (not again by a pipeline stage's recomputed forward).
        cuda::sequence_balance(ctx, A.probs, A.topk, in.doc_rows, Tn, in.docs, E_, k_, aux_work_,
                               aux_counts_, aux_psum_);
        cp_allreduce(ctx, in, aux_counts_, in.docs * E_);
        cuda::sequence_aux_loss(ctx, aux_counts_, aux_psum_, in.doc_fscale, in.doc_weight, in.docs,
                                E_, A.aux_f, in.recompute ? nullptr : A.aux_sum);
    }
    cuda::moe_permute(ctx, A.topk, Tn, E_, k_, capacity_, A.counts, A.offsets, A.slot_row,
                      A.perm_token);
    if (!in.recompute) cuda::moe_count_load(ctx, A.counts, E_, capacity_, load_, dropped_);
    if (chunked()) {
        // A redo over the receive budget: each chunk's rows to the experts and back.
        for (int64_t t0 = 0; t0 < Tn; t0 += chunk_tokens_) {
            const int64_t n = std::min(chunk_tokens_, Tn - t0);
            dispatch_chunk(ctx, A, m, t0, n);
            bf16* out = ep_->begin_send(ctx);
            experts_forward(ctx, local(A), A, out);
            bf16* out_perm = A.out_perm + t0 * k_ * h_;
            ep_->combine(ctx, A.ep_offsets, out_perm);
            cuda::moe_combine(ctx, out_perm, A.slot_row + t0 * k_, A.gates + t0 * k_, n, k_, h_,
                              y + t0 * h_);
        }
        if (shared_) shared_->forward(ctx, A.shared, m, y);
        return;
    }
    if (W_ > 1) {
        // The permuted rows, gathered straight into the exchange's shared region, to their
        // experts' ranks.
        ST_ASSERT(ep_, "CUDA MoE: expert parallelism without an exchange (set_exchange)");
        cuda::moe_gather(ctx, m, A.perm_token, A.offsets, E_, R, h_, ep_->begin_send(ctx));
        ep_->dispatch(ctx, A.offsets, A.ep_offsets, A.recv_offsets, A.xperm);
    } else {
        cuda::moe_gather(ctx, m, A.perm_token, A.offsets, E_, R, h_, A.xperm, rows8(0));
    }
    const Local L = local(A);
    bf16* out = W_ > 1 ? ep_->begin_send(ctx) : A.out_perm;  // the results go back from there
    experts_forward(ctx, L, A, out);
    if (W_ > 1) ep_->combine(ctx, A.ep_offsets, A.out_perm);
    cuda::moe_combine(ctx, A.out_perm, A.slot_row, A.gates, Tn, k_, h_, y);
    // The kept rows (offsets[E] of them) into pages: the next application reuses the buffers.
    if (stash_ && !stash_->bypassed())
        stash_->push(ctx, A.stash_table, stashed_rows(A), stashed(A));
    if (shared_) shared_->forward(ctx, A.shared, m, y);
}

void CudaMoeLayer::dispatch_chunk(const ExecContext& ctx, const Acts& A, const bf16* m, int64_t t0,
                                  int64_t n) const {
    cuda::moe_permute(ctx, A.topk + t0 * k_, n, E_, k_, capacity_, A.counts, A.offsets,
                      A.slot_row + t0 * k_, A.perm_token);
    cuda::moe_gather(ctx, m + t0 * h_, A.perm_token, A.offsets, E_, n * k_, h_,
                     ep_->begin_send(ctx));
    ep_->dispatch(ctx, A.offsets, A.ep_offsets, A.recv_offsets, A.xperm);
}

void CudaMoeLayer::backward(const ExecContext& ctx, const Acts& A, const bf16* m, const bf16* dy,
                            const CudaInputs& in, bf16* dm) const {
    const int64_t Tn = T_, R = T_ * k_;
    if (chunked()) {
        // A redo over the receive budget: each chunk's expert rows again (its rows to the
        // experts' ranks, their gate / up GEMMs and SwiGLU), then its backward.
        for (int64_t t0 = 0; t0 < Tn; t0 += chunk_tokens_) {
            const int64_t n = std::min(chunk_tokens_, Tn - t0);
            dispatch_chunk(ctx, A, m, t0, n);
            experts_swiglu(ctx, local(A), A);
            backward_span(ctx, A, m, dy, dm, t0, n);
        }
    } else {
        if (stash_ && stash_->bypassed()) {
            // An eager redo without pages: the forward's expert rows again, from the layer input
            // (under expert parallelism sent to the experts' ranks again: every rank redoes).
            if (W_ > 1) {
                cuda::moe_gather(ctx, m, A.perm_token, A.offsets, E_, R, h_, ep_->begin_send(ctx));
                ep_->dispatch_again(ctx, A.ep_offsets, A.xperm);
            } else {
                cuda::moe_gather(ctx, m, A.perm_token, A.offsets, E_, R, h_, A.xperm, rows8(0));
            }
            experts_swiglu(ctx, local(A), A);
        } else if (stash_) {
            // Back from the pages; the SwiGLU recomputed (the same kernel on the same values:
            // bit-identical to what the forward used), the permuted input below (or from the
            // pages under expert parallelism).
            stash_->pop(ctx, A.stash_table, stashed_rows(A), stashed(A));
            cuda::swiglu_forward(ctx, A.g, A.u, rows_ * F_, A.act);
        } else if (recompute_act_) {
            cuda::swiglu_forward(ctx, A.g, A.u, rows_ * F_, A.act);  // selective: moe_act
        }
        backward_span(ctx, A, m, dy, dm, 0, Tn);
    }
    if (shared_) shared_->backward(ctx, A.shared, m, dy, dm, true);
    cuda::router_backward(ctx, A.probs, A.topk, dgates_, Tn, E_, k_,
                          float(c_.moe_router_topk_scaling_factor), dlogits_);
    if (aux_)
        cuda::sequence_aux_backward(ctx, A.probs, in.doc_rows, Tn, in.docs, E_, A.aux_f,
                                    in.doc_weight, dlogits_);
    for (int64_t r0 = 0; r0 < Tn; r0 += Br_) {
        const int64_t n = std::min(Br_, Tn - r0);
        cuda::bf16_to_f32(ctx, m + r0 * h_, A.m32, n * h_);
        gemm(ctx, true, false, E_, h_, n, 1.f, dlogits_ + r0 * E_, E_, A.m32, h_,
             P_.grad_beta(router_), P_[router_].grad, h_, F32, F32);
    }
    cuda::f32_to_bf16(ctx, dlogits_, dlogits_bf_, Tn * E_);
    gemm(ctx, false, false, Tn, h_, E_, 1.f, dlogits_bf_, E_, P_[router_].w, h_, 1.f, dm, h_);
}

void CudaMoeLayer::backward_span(const ExecContext& ctx, const Acts& A, const bf16* m,
                                 const bf16* dy, bf16* dm, int64_t t0, int64_t n) const {
    const int64_t R = n * k_;
    const int32_t* slot_row = A.slot_row + t0 * k_;
    const float* gates = A.gates + t0 * k_;
    float* dgates = dgates_ + t0 * k_;
    bf16 *const dxperm = doutperm_, *const dg = dact_;  // shared storage (the constructor)
    if (W_ > 1) {
        // Expert parallelism: the output gradients scaled by their gates, written straight into
        // the exchange's region, to the experts' ranks (the input gradients come back the same
        // way); the gate gradients from the output rows that came back in the forward.
        cuda::moe_combine_backward(ctx, dy + t0 * h_, A.out_perm + t0 * k_ * h_, slot_row, gates, n,
                                   k_, h_, ep_->begin_send(ctx), dgates);
        ep_->dispatch_again(ctx, A.ep_offsets, dout_owner_);
    } else {
        // The output gradients unscaled (and their FP8 copy): the gates scale them after the
        // down projection (moe_gate_backward_rows).
        cuda::moe_gather(ctx, dy, A.perm_token, A.offsets, E_, R, h_, doutperm_, rows8(0));
    }
    const bf16* dout = W_ > 1 ? dout_owner_ : doutperm_;
    const Local L = local(A);
    // Elements between consecutive experts' gradients (fp32, or bf16 gradient buffers).
    const CudaParam& g0 = P_[gate0_];
    const int64_t gs = El_ > 1 ? (static_cast<char*>(P_[gate0_ + wstride_].grad_out()) -
                                  static_cast<char*>(g0.grad_out())) /
                                     int64_t(dtype_size(g0.grad_type()))
                               : F_ * h_;
    const CudaParam &gate = P_[gate0_ + L.first * wstride_], &up = P_[up0_ + L.first * wstride_],
                    &down = P_[down0_ + L.first * wstride_];
    // The grouped weight gradients write every local expert's gradient (zeros for one with no
    // rows) on the step's first write, and add after it (a redo's later chunks too): no memset
    // of the experts' fp32 gradients, and their old tiles are not read.
    const bool add = expert_grads_added(L);
    expert_gemm(ctx, L, down0_, true, dout, dact_, false, fp8_ && W_ == 1);
    if (W_ == 1)
        cuda::moe_gate_backward_rows(ctx, dact_, A.act, slot_row, gates, n, k_, F_, h_, doutperm_,
                                     dgates);
    cuda::grouped_gemm(ctx, weight_grad(L, h_, F_, dout, A.act, down, gs, add));
    if (fp8_)
        cuda::swiglu_backward(ctx, A.g, A.u, dact_, rows_, F_, dg, du_, rows8(0), rows8(1));
    else
        cuda::swiglu_backward(ctx, A.g, A.u, dact_, rows_ * F_, dg, du_);
    bf16* dx = W_ > 1 ? ep_->begin_send(ctx) : dxperm;
    // The SwiGLU backward wrote both FP8 copies: the gate's input gradient in slot 0, the up
    // projection's in slot 1.
    expert_gemm(ctx, L, gate0_, true, dg, dx, false, fp8_ != nullptr, 0);
    expert_gemm(ctx, L, up0_, true, du_, dx, true, fp8_ != nullptr, 1);
    if (W_ > 1) ep_->combine(ctx, A.ep_offsets, dxperm);
    cuda::moe_gather_backward(ctx, dxperm, slot_row, n, k_, h_, dm + t0 * h_, false);
    // Without expert parallelism the gathered input rows again (the forward's copy), into the
    // rows the input gradients just left; under it they were received and kept.
    if (W_ == 1) cuda::moe_gather(ctx, m, A.perm_token, A.offsets, E_, R, h_, A.xperm);
    cuda::grouped_gemm(ctx, weight_grad(L, F_, h_, dg, A.xperm, gate, gs, add));
    cuda::grouped_gemm(ctx, weight_grad(L, F_, h_, du_, A.xperm, up, gs, add));
}

void CudaMoeLayer::experts_swiglu(const ExecContext& ctx, const Local& L, const Acts& A) const {
    // FP8 copies from the producers: the gathered rows (not under expert parallelism: they are
    // received), the SwiGLU output.
    expert_gemm(ctx, L, gate0_, false, A.xperm, A.g, false, fp8_ && W_ == 1);
    expert_gemm(ctx, L, up0_, false, A.xperm, A.u, false, true);
    cuda::swiglu_forward(ctx, A.g, A.u, rows_, F_, A.act, rows8(0));
}

void CudaMoeLayer::experts_forward(const ExecContext& ctx, const Local& L, const Acts& A,
                                   bf16* out) const {
    experts_swiglu(ctx, L, A);
    expert_gemm(ctx, L, down0_, false, A.act, out, false, fp8_ != nullptr);
}

void CudaMoeLayer::expert_gemm(const ExecContext& ctx, const Local& L, int64_t first, bool dgrad,
                               const bf16* x, bf16* y, bool accumulate, bool x_quantized,
                               int slot) const {
    const ParamInfo& info = P_.store().params()[size_t(first)];
    const int64_t N = info.shape[0], K = info.shape[1];  // W [N, K]
    const int64_t in = dgrad ? N : K, out = dgrad ? K : N;
    if (fp8_) {
        const int h = fp8_experts_[first == gate0_ ? 0 : first == up0_ ? 1 : 2];
        const Fp8Weights::Experts& W = fp8_->experts(h);
        ST_ASSERT(fp8_rows_[slot], "CUDA MoE: FP8 row slot ", slot, " was not planned");
        if (!x_quantized)
            cuda::quantize_fp8_1x128(ctx, x, rows_, in, in, kFp8Pow2Scales, fp8_rows_[slot],
                                     fp8_row_scales_[slot]);
        cuda::grouped_gemm_fp8(ctx, {.offsets = L.offsets,
                                     .experts = L.experts,
                                     .max_rows = L.max_rows,
                                     .row_capacity = rows_,
                                     .n = out,
                                     .k = in,
                                     .x = {fp8_rows_[slot], fp8_row_scales_[slot], false},
                                     .w = dgrad ? W.dgrad(L.first) : W.forward(L.first),
                                     .y = y,
                                     .accumulate = accumulate});
        return;
    }
    // The expert weights are consecutive parameters: one stride apart in every arena.
    const int64_t ws = El_ > 1 ? P_[first + wstride_].w - P_[first].w : N * K;
    using Kind = cuda::GroupedGemm;
    cuda::grouped_gemm(ctx, {.kind = dgrad ? Kind::RowsTimesWeight : Kind::RowsTimesWeightT,
                             .offsets = L.offsets,
                             .experts = L.experts,
                             .max_rows = L.max_rows,
                             .row_capacity = rows_,
                             .n = N,
                             .k = K,
                             .a = x,
                             .b = P_[first + L.first * wstride_].w,
                             .c = y,
                             .weight_stride = ws,
                             .accumulate = accumulate});
}

cuda::GroupedGemmArgs CudaMoeLayer::weight_grad(const Local& L, int64_t n, int64_t k,
                                                const bf16* dy, const bf16* x, const CudaParam& dw,
                                                int64_t stride, bool add) const {
    return {.kind = cuda::GroupedGemm::WeightGrad,
            .offsets = L.offsets,
            .experts = L.experts,
            .max_rows = L.max_rows,
            .row_capacity = rows_,
            .n = n,
            .k = k,
            .a = dy,
            .b = x,
            .c = dw.grad_out(),
            .weight_stride = stride,
            .accumulate = add,
            .grad_type = dw.grad_type()};
}

cuda::Fp8RowsOut CudaMoeLayer::rows8(int slot) const {
    if (!fp8_) return {};
    return {fp8_rows_[slot], fp8_row_scales_[slot], rows_, kFp8Pow2Scales};
}

CudaMoeLayer::Local CudaMoeLayer::local(const Acts& A) const {
    if (W_ == 1) return {A.offsets, E_, capacity_, 0};
    ST_ASSERT(ep_->rank() == c_.expert_parallel_rank, "CUDA MoE: EP rank ", ep_->rank(),
              " holds the weights of EP rank ", c_.expert_parallel_rank);
    return {A.recv_offsets, El_, std::min(rows_, W_ * c_.moe_rows_per_expert_from_one_source(T_)),
            0};
}

bool CudaMoeLayer::expert_grads_added(const Local& L) const {
    int adds = 0, total = 0;
    for (int64_t e = 0; e < L.experts; ++e)
        for (int64_t first : {gate0_, up0_, down0_}) {
            adds += P_.grad_beta(first + (L.first + e) * wstride_) != 0.f;
            ++total;
        }
    ST_ASSERT(adds == 0 || adds == total, "CUDA MoE: ", adds, " of ", total,
              " expert gradients already written this step");
    return adds > 0;
}

void CudaMoeLayer::check_layout() const {
    // Every arena: the bf16 copies (null under FP8, which has none), the gradients, and the fp32
    // masters where a kernel reads them (the FP8 weight quantizer reads all experts of a kind at
    // one stride; elsewhere the distributed optimizer may keep some on other ranks).
    auto fixed_stride = [&](int64_t first, auto member) {
        const auto* p0 = P_[first].*member;
        const int64_t s = El_ > 1 ? P_[first + wstride_].*member - p0 : 0;
        for (int64_t e = 0; e < El_; ++e)
            if (P_[first + e * wstride_].*member != p0 + e * s) return false;
        return true;
    };
    for (int64_t first : {gate0_, up0_, down0_})
        ST_CHECK(fixed_stride(first, &CudaParam::w) && fixed_stride(first, &CudaParam::grad) &&
                     fixed_stride(first, &CudaParam::grad16) &&
                     (!P_.master_read(first) || fixed_stride(first, &CudaParam::master)),
                 "CUDA MoE: the experts of '", P_.store().params()[first].name,
                 "' are not at a fixed stride (the grouped GEMMs need one)");
    ST_CHECK(El_ <= 1 ||
                 (P_[gate0_ + wstride_].w - P_[gate0_].w == P_[up0_ + wstride_].w - P_[up0_].w &&
                  P_[gate0_ + wstride_].w - P_[gate0_].w == P_[down0_ + wstride_].w - P_[down0_].w),
             "CUDA MoE: gate/up/down expert strides differ");
}

void CudaMoeLayer::reset_stats(const ExecContext& ctx) const {
    cuda::zero(ctx, load_, E_ * sizeof(int64_t));
    cuda::zero(ctx, dropped_, sizeof(int64_t));
}

void CudaMoeLayer::update_bias(const ExecContext& ctx, double rate) const {
    if (rate == 0) return;
    cuda::moe_update_bias(ctx, load_, E_, float(rate), P_[bias_].master);
}

}  // namespace sparsetron::cuda
