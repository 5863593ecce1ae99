#include "sparsetron/model/glm5_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "sparsetron/model/param_table.h"

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/model/cp_rows.h"
#include "sparsetron/model/fp8_gemms.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/loss/loss.h"
#include "sparsetron/ops/norm/norm.h"
#include "sparsetron/parallel/context/cp_shard.h"

namespace sparsetron {

using cpu::gemm;

template <typename T>
Glm5Model<T>::Glm5Model(const ModelConfig& cfg, MemoryPlan& plan, int64_t tokens, int64_t max_docs,
                        int64_t chunk_rows, int64_t key_tokens, const PipelineStage& stage)
    : Glm5Model(cfg, make_param_table(cfg, plan, dtype_of<T>(), stage), plan, tokens, max_docs,
                chunk_rows, key_tokens, stage) {}

template <typename T>
Glm5Model<T>::Glm5Model(const ModelConfig& cfg, std::unique_ptr<ParamStore> owned, MemoryPlan& plan,
                        int64_t tokens, int64_t max_docs, int64_t chunk_rows, int64_t key_tokens,
                        const PipelineStage& stage)
    : Glm5Model(cfg, *owned, plan, tokens, max_docs, chunk_rows, key_tokens, stage) {
    owned_store_ = std::move(owned);
}

template <typename T>
Glm5Model<T>::Glm5Model(const ModelConfig& cfg, const ParamStore& params, MemoryPlan& plan,
                        int64_t tokens, int64_t max_docs, int64_t chunk_rows, int64_t key_tokens,
                        const PipelineStage& stage)
    : cfg_(cfg),
      plan_(plan),
      stage_(stage),
      L0_(stage.first_layer),
      L1_(stage.end_layer < 0 ? cfg.num_layers : stage.end_layer),
      buf_(plan, dtype_of<T>()),
      T_(tokens),
      max_docs_(max_docs),
      chunk_rows_(std::min(chunk_rows, tokens)),
      cp_(key_tokens > 0),
      Tk_(key_tokens > 0 ? key_tokens : tokens) {
    if (cp_) require_dsa_for_context_parallel(cfg);
    ST_CHECK(tokens > 0 && max_docs > 0 && chunk_rows > 0, "model: bad micro-batch shape");
    store_ = &params;
    ++constructed_;
    const int64_t h = cfg.hidden_size, Tn = tokens;
    s_tokens_ = buf_.act_i32("inputs.tokens", {Tn});
    s_targets_ = buf_.act_i32("inputs.targets", {Tn});
    s_positions_ = buf_.act_i32("inputs.positions", {Tn});
    s_cu_ = buf_.act_i32("inputs.cu_seqlens", {max_docs + 1});
    if (cp_) {
        s_key_row_ = buf_.act_i32("inputs.cp_key_row", {Tn});
        s_key_cu_ = buf_.act_i32("inputs.cp_key_cu_seqlens", {max_docs + 1});
    }

    const bool last = stage.last();
    // The MTP layer (on the last stage) reads the embedding table.
    if (stage.first() || (last && cfg.mtp_num_layers > 0))
        embed_ = store_->index("model.embed_tokens.weight");
    for (int64_t l = L0_; l < L1_; ++l) {
        layers_.push_back(
            std::make_unique<DecoderLayer<T>>(cfg_, *store_, buf_, l, tokens, key_tokens));
        s_x_.push_back(buf_.act(cat("layers.", l, ".x_in"), {Tn, h}));
        layer_slots_.push_back(layers_.back()->declare_acts(buf_, cat("layers.", l, ".")));
    }
    s_x_.push_back(buf_.act(last ? std::string("final.x") : cat("layers.", L1_, ".x_in"), {Tn, h}));
    s_dx_ = buf_.scratch("grad.residual", {Tn, h});
    if (last) {
        final_norm_ = store_->index("model.norm.weight");
        head_ = store_->index("lm_head.weight");
        s_h_final_ = buf_.act("final.norm_out", {Tn, h});
        s_rstd_final_ = buf_.act("final.norm_rstd", {Tn});
        s_dh_ = buf_.scratch("grad.final_norm_out", {Tn, h});
        s_logits_ = buf_.scratch("head.logits_chunk", {chunk_rows_, cfg.vocab_size});
    }

    D_ = last ? cfg.mtp_num_layers : 0;
    if (D_ > 0) {
        const int64_t L = cfg.num_layers;
        // Distinct layers take the indices after the backbone's (HF's model.layers.{L + j}).
        for (int64_t j = 0; j < cfg.mtp_physical_layers(); ++j) {
            const std::string p = cat("model.layers.", L + j, ".");
            MtpLayer m;
            m.enorm = store_->index(p + "enorm.weight");
            m.hnorm = store_->index(p + "hnorm.weight");
            m.eh_proj = store_->index(p + "eh_proj.weight");
            m.layer =
                std::make_unique<DecoderLayer<T>>(cfg_, *store_, buf_, L + j, tokens, key_tokens);
            m.norm = store_->index(p + "shared_head.norm.weight");
            mtp_layers_.push_back(std::move(m));
        }
        for (int64_t k = 1; k <= D_; ++k) {
            const std::string a = cat("mtp.depth", k, ".");
            MtpSlots s{};
            s.ids = buf_.act_i32(a + "input_ids", {Tn});
            s.e = buf_.act(a + "embedding", {Tn, h});
            s.en = buf_.act(a + "enorm_out", {Tn, h});
            s.rstd_e = buf_.act(a + "enorm_rstd", {Tn});
            s.hn = buf_.act(a + "hnorm_out", {Tn, h});
            s.rstd_h = buf_.act(a + "hnorm_rstd", {Tn});
            s.cat = buf_.act(a + "concat", {Tn, 2 * h});
            s.hin = buf_.act(a + "layer_in", {Tn, h});
            s.hout = buf_.act(a + "layer_out", {Tn, h});
            s.hz = buf_.act(a + "head_norm_out", {Tn, h});
            s.rstd_z = buf_.act(a + "head_norm_rstd", {Tn});
            s.layer = mtp_at(k - 1).layer->declare_acts(buf_, a);
            mtp_slots_.push_back(s);
            s_mtp_targets_.push_back(buf_.act_i32(a + "targets", {Tn}));
            s_dmtp_zk_.push_back(buf_.scratch(cat("grad.mtp.head_norm_out.", k), {Tn, h}));
        }
        if (kv_share())
            s_dmtp_kv_ = buf_.scratch("grad.mtp.k_latent_shared",
                                      {Tn, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim});
        s_dmtp_h_ = buf_.scratch("grad.mtp.hidden", {Tn, h});
        s_dmtp_cat_ = buf_.scratch("grad.mtp.concat", {Tn, 2 * h});
        s_dmtp_z_ = buf_.scratch("grad.mtp.layer_out", {Tn, h});
        s_dmtp_e_ = buf_.scratch("grad.mtp.embedding", {Tn, h});
        if (cfg.mtp_loss_type == "e2e_tv") {
            s_tv_p_ = buf_.scratch("mtp.tv.target_probs", {D_, chunk_rows_, cfg.vocab_size});
            s_tv_q_ = buf_.scratch("mtp.tv.draft_probs", {D_, chunk_rows_, cfg.vocab_size});
            s_tv_alpha_ = buf_.scratch("mtp.tv.alpha", {D_, Tn});
            if (cp_) {
                s_h_final_keys_ = buf_.act("mtp.tv.final_norm_out_all_rows", {Tk_, h});
                s_tv_rows_ = buf_.scratch("mtp.tv.target_rows", {chunk_rows_, h});
            }
        }
    }
}

template <typename T>
Glm5Model<T>::~Glm5Model() = default;

template <typename T>
std::atomic<int64_t> Glm5Model<T>::constructed_{0};

template <typename T>
void Glm5Model<T>::bind() {
    param_ptr_.clear(), grad_ptr_.clear();
    for (const auto& p : store_->params()) {
        param_ptr_.push_back(buf_.ptr<T>(p.param_slot));
        grad_ptr_.push_back(p.grad_slot < 0 ? nullptr : buf_.ptr<T>(p.grad_slot));
    }
    in_.tokens = T_;
    in_.token_ids = buf_.ptr<int32_t>(s_tokens_);
    in_.positions = buf_.ptr<int32_t>(s_positions_);
    in_.cu_seqlens = buf_.ptr<int32_t>(s_cu_);
    in_.key_tokens = Tk_;
    if (cp_) {
        in_.key_row = buf_.ptr<int32_t>(s_key_row_);
        in_.key_cu_seqlens = buf_.ptr<int32_t>(s_key_cu_);
    }
    targets_ = buf_.ptr<int32_t>(s_targets_);
    x_.clear();
    for (auto s : s_x_) x_.push_back(buf_.ptr<T>(s));
    layer_acts_.clear();
    for (size_t l = 0; l < layers_.size(); ++l) {
        layers_[l]->bind(buf_, param_ptr_, grad_ptr_);
        layer_acts_.push_back(layers_[l]->resolve(buf_, layer_slots_[l]));
    }
    // IndexShare: a shared layer attends over its source layer's top-k, an earlier layer of
    // this stage (check_index_share_pipeline_split refuses a split that would put it on another).
    for (size_t l = 0; l < layers_.size(); ++l) {
        auto& A = layer_acts_[l];
        const int64_t layer0 = L0_ + static_cast<int64_t>(l);
        if (!cfg_.uses_dsa() || A.topk) continue;
        const int64_t src = dsa_source_layer(cfg_, layer0);
        ST_CHECK(src >= L0_ && src < layer0 && layer_acts_[size_t(src - L0_)].topk, "DSA layer ",
                 layer0, " shares the top-k of layer ", src, ", which this stage does not compute");
        A.topk = layer_acts_[size_t(src - L0_)].topk;
        A.topk_len = layer_acts_[size_t(src - L0_)].topk_len;
    }
    dx_ = buf_.ptr<T>(s_dx_);
    if (stage_.last()) {
        h_final_ = buf_.ptr<T>(s_h_final_), rstd_final_ = buf_.ptr<T>(s_rstd_final_);
        dh_ = buf_.ptr<T>(s_dh_), logits_ = buf_.ptr<T>(s_logits_);
    }
    if (D_ > 0) {
        for (auto& m : mtp_layers_) m.layer->bind(buf_, param_ptr_, grad_ptr_);
        mtp_acts_.clear(), mtp_targets_.clear(), dmtp_zk_.clear();
        for (int64_t k = 0; k < D_; ++k) {
            const MtpSlots& s = mtp_slots_[k];
            auto P = [&](MemoryPlan::Slot x) { return buf_.ptr<T>(x); };
            MtpActs a{buf_.ptr<int32_t>(s.ids),
                      P(s.e),
                      P(s.en),
                      P(s.rstd_e),
                      P(s.hn),
                      P(s.rstd_h),
                      P(s.cat),
                      P(s.hin),
                      P(s.hout),
                      P(s.hz),
                      P(s.rstd_z),
                      mtp_at(k).layer->resolve(buf_, s.layer)};
            if (kv_share() && k > 0) {
                // Depths 2..D reuse depth 1's latent K' and top-k (dsa_mtp_index_kv_share).
                const auto& first = mtp_acts_[0].layer;
                a.layer.attn.kabs_shared = first.attn.kkeys;
                a.layer.topk = first.topk, a.layer.topk_len = first.topk_len;
                a.layer.skip_indexer = true;
            }
            mtp_acts_.push_back(a);
            mtp_targets_.push_back(buf_.ptr<int32_t>(s_mtp_targets_[k]));
            dmtp_zk_.push_back(buf_.ptr<T>(s_dmtp_zk_[k]));
        }
        dmtp_h_ = buf_.ptr<T>(s_dmtp_h_), dmtp_cat_ = buf_.ptr<T>(s_dmtp_cat_);
        dmtp_z_ = buf_.ptr<T>(s_dmtp_z_), dmtp_e_ = buf_.ptr<T>(s_dmtp_e_);
        if (kv_share()) dmtp_kv_ = buf_.ptr<T>(s_dmtp_kv_);
        if (cfg_.mtp_loss_type == "e2e_tv") {
            tv_p_ = buf_.ptr<T>(s_tv_p_), tv_q_ = buf_.ptr<T>(s_tv_q_);
            tv_alpha_ = buf_.ptr<T>(s_tv_alpha_);
            if (cp_)
                h_final_keys_ = buf_.ptr<T>(s_h_final_keys_), tv_rows_ = buf_.ptr<T>(s_tv_rows_);
        }
    }
}

template <typename T>
void Glm5Model<T>::load_inputs(const MicroBatch& mb) {
    ST_CHECK(mb.capacity == Tk_ && mb.max_documents == max_docs_, "micro-batch of ", mb.capacity,
             " slots / ", mb.max_documents, " documents does not match the plan (", Tk_, " / ",
             max_docs_, ")");
    for (int64_t i = 0; i < Tk_; ++i)
        ST_CHECK(mb.tokens[i] >= 0 && mb.tokens[i] < cfg_.vocab_size, "token id ", mb.tokens[i],
                 " is outside the vocabulary (vocab_size ", cfg_.vocab_size, ")");
    int32_t* tok = const_cast<int32_t*>(in_.token_ids);
    int32_t* pos = const_cast<int32_t*>(in_.positions);
    int32_t* cu = const_cast<int32_t*>(in_.cu_seqlens);
    in_.num_docs = mb.num_documents;
    if (!cp_) {
        std::memcpy(tok, mb.tokens.data(), T_ * sizeof(int32_t));
        std::memcpy(targets_, mb.targets.data(), T_ * sizeof(int32_t));
        std::memcpy(pos, mb.positions.data(), T_ * sizeof(int32_t));
        std::memcpy(cu, mb.cu_seqlens.data(), (max_docs_ + 1) * sizeof(int32_t));
    } else {
        // This CP rank's rows: chunks r and 2cp-1-r of every document, documents in order.
        // No group: this rank holds every row (dynamic CP's groups of one rank).
        const int cp = in_.cp ? in_.cp->size() : 1, rank = in_.cp ? in_.cp->rank() : 0;
        int32_t* key_row = const_cast<int32_t*>(in_.key_row);
        std::fill_n(tok, T_, 0), std::fill_n(targets_, T_, -1), std::fill_n(pos, T_, 0);
        std::fill_n(key_row, T_, -1);
        int64_t n = 0;
        for (int64_t d = 0; d < mb.num_documents; ++d) {
            cu[d] = static_cast<int32_t>(n);
            const int64_t b = mb.cu_seqlens[d], len = mb.cu_seqlens[d + 1] - b;
            for (const RowRange& rr : cp_rows(len, cp, rank))
                for (int64_t i = rr.begin; i < rr.end; ++i, ++n) {
                    ST_CHECK(n < T_, "CP rank ", rank, " holds more than the ", T_,
                             " rows it was planned for");
                    const int64_t g = b + i;
                    tok[n] = mb.tokens[g], targets_[n] = mb.targets[g];
                    pos[n] = mb.positions[g], key_row[n] = static_cast<int32_t>(g);
                }
        }
        for (int64_t d = mb.num_documents; d <= max_docs_; ++d) cu[d] = static_cast<int32_t>(n);
        std::memcpy(const_cast<int32_t*>(in_.key_cu_seqlens), mb.cu_seqlens.data(),
                    (max_docs_ + 1) * sizeof(int32_t));
    }
    // MTP: depth k reads the token at micro-batch row g+k and predicts row g+k+1, inside g's
    // document only (under CP those rows may belong to another rank: every rank has the tokens).
    const int32_t* kcu = key_cu_seqlens(in_);
    for (int64_t k = 1; k <= D_; ++k) {
        int32_t* ids = mtp_acts_[k - 1].ids;
        int32_t* tg = mtp_targets_[k - 1];
        std::fill_n(ids, T_, -1);
        std::fill_n(tg, T_, -1);
        for (int64_t d = 0; d < in_.num_docs; ++d) {
            const int64_t e = kcu[d + 1];
            for (int64_t i = in_.cu_seqlens[d]; i < in_.cu_seqlens[d + 1]; ++i) {
                const int64_t g = key_row(in_, i);
                if (g + k < e) ids[i] = mb.tokens[g + k];
                if (g + k + 1 < e) tg[i] = mb.tokens[g + k + 1];
            }
        }
    }
}

template <typename T>
LossSums Glm5Model<T>::forward_backward(double lm_scale, bool backward) {
    LossScales sc;
    sc.backward = backward;
    sc.lm = lm_scale;
    return forward_backward(sc);
}

template <typename T>
LossSums Glm5Model<T>::forward_backward(const LossScales& sc) {
    LossSums out = forward(sc);
    if (sc.backward) backward(sc);
    return out;
}

template <typename T>
LossSums Glm5Model<T>::forward(const LossScales& sc) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    LossSums out;
    in_.indexer_tokens = sc.indexer_tokens;
    if (stage_.first())
        cpu::embedding_forward(in_.token_ids, Tn, param(embed_), c.vocab_size, h, x_[0]);
    const double idx_gs = sc.backward || sc.indexer_grads ? sc.indexer : 0.0;
    for (size_t l = 0; l < layers_.size(); ++l) {
        LayerLosses ll = layers_[l]->forward(layer_acts_[l], x_[l], x_[l + 1], in_, idx_gs, sc.aux);
        out.indexer_loss += ll.indexer;
        if (layers_[l]->has_indexer())
            out.indexer_layers.emplace_back(stage_.first_layer + int64_t(l), ll.indexer);
        out.aux_loss += ll.aux;
    }
    if (!stage_.last()) return out;
    cpu::rmsnorm_forward(x_.back(), h, param(final_norm_), Tn, h, c.norm_epsilon, h_final_, h,
                         rstd_final_);
    cpu::head_cross_entropy(h_final_, Tn, h, param(head_), c.vocab_size, targets_, chunk_rows_,
                            logits_, sc.lm, sc.backward ? dh_ : (T*)nullptr,
                            sc.backward ? grad(head_) : (T*)nullptr, &out.lm_loss_sum,
                            &out.lm_targets);
    if (D_ > 0) mtp_forward(sc, out);
    return out;
}

template <typename T>
void Glm5Model<T>::backward(const LossScales& sc) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    if (stage_.last()) {
        if (D_ > 0) mtp_backward(sc);  // adds into dh_ unless the heads are detached
        cpu::rmsnorm_backward(dh_, h, x_.back(), h, param(final_norm_), rstd_final_, Tn, h, dx_, h,
                              false, grad(final_norm_));
    }
    for (size_t l = layers_.size(); l-- > 0;)
        layers_[l]->backward(layer_acts_[l], x_[l], dx_, in_, sc.aux);
    if (stage_.first())
        cpu::embedding_backward(in_.token_ids, Tn, dx_, c.vocab_size, h, grad(embed_));
}

template <typename T>
void Glm5Model<T>::save_activations(ActivationSnapshot& into) const {
    const size_t n = activation_bytes();
    into.bytes.resize(n);
    std::memcpy(into.bytes.data(), plan_.class_base(MemClass::Activations), n);
    into.layers = layer_acts_;
    into.mtp = mtp_acts_;
    into.in = in_;
}

template <typename T>
void Glm5Model<T>::restore_activations(const ActivationSnapshot& from) {
    ST_ASSERT(from.bytes.size() == activation_bytes(), "activation snapshot of another plan");
    std::memcpy(plan_.class_base(MemClass::Activations), from.bytes.data(), from.bytes.size());
    layer_acts_ = from.layers;
    mtp_acts_ = from.mtp;
    in_ = from.in;
}

template <typename T>
void Glm5Model<T>::mtp_forward(const LossScales& sc, LossSums& out) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    const T* prev = h_final_;
    const double idx_gs = sc.backward || sc.indexer_grads ? sc.indexer : 0.0;
    for (int64_t k = 0; k < D_; ++k) {
        MtpActs& A = mtp_acts_[k];
        parallel_for(
            Tn,
            [&](int64_t b, int64_t e) {
                for (int64_t i = b; i < e; ++i) {
                    T* row = A.e + i * h;
                    if (A.ids[i] < 0)
                        std::fill_n(row, h, T(0));  // no input crosses a document
                    else
                        std::copy_n(param(embed_) + int64_t(A.ids[i]) * h, h, row);
                }
            },
            16);
        const MtpLayer& M = mtp_at(k);
        cpu::rmsnorm_forward(A.e, h, param(M.enorm), Tn, h, c.norm_epsilon, A.en, h, A.rstd_e);
        cpu::rmsnorm_forward(prev, h, param(M.hnorm), Tn, h, c.norm_epsilon, A.hn, h, A.rstd_h);
        for (int64_t i = 0; i < Tn; ++i) {
            std::copy_n(A.en + i * h, h, A.cat + i * 2 * h);  // embedding half first
            std::copy_n(A.hn + i * h, h, A.cat + i * 2 * h + h);
        }
        linear_forward(fp8_, A.cat, 2 * h, Tn, 2 * h, param(M.eh_proj), h, A.hin, h, false);
        LayerLosses ll = M.layer->forward(A.layer, A.hin, A.hout, in_, idx_gs, sc.aux);
        out.indexer_loss += ll.indexer;
        if (M.layer->has_indexer() && !A.layer.skip_indexer)
            out.indexer_layers.emplace_back(c.num_layers + k, ll.indexer);
        out.aux_loss += ll.aux;
        out.mtp_aux_loss += ll.aux;
        cpu::rmsnorm_forward(A.hout, h, param(M.norm), Tn, h, c.norm_epsilon, A.hz, h, A.rstd_z);
        prev = A.hout;
    }
    if (c.mtp_loss_type == "e2e_tv") {
        mtp_tv_loss(sc, out);
        return;
    }
    out.mtp_sum.assign(D_, 0.0);
    out.mtp_count.assign(D_, 0);
    for (int64_t k = 0; k < D_; ++k) {
        const double scale = sc.backward ? sc.mtp.at(k) : 0.0;
        T* dw = sc.backward && !c.mtp_detach_heads ? grad(head_) : nullptr;
        cpu::head_cross_entropy(mtp_acts_[k].hz, Tn, h, param(head_), c.vocab_size, mtp_targets_[k],
                                chunk_rows_, logits_, scale,
                                sc.backward ? dmtp_zk_[k] : (T*)nullptr, dw, &out.mtp_sum[k],
                                &out.mtp_count[k]);
    }
}

template <typename T>
void Glm5Model<T>::mtp_tv_loss(const LossScales& sc, LossSums& out) {
    // e2e_tv (SPEC §5): p_k[i] = softmax(z_main[i+k]) (no gradient), q_k[i] = softmax(z^k[i]),
    // α_k = Σ_v min(p, q); per start row whose whole chain stays in its document,
    // L = (1/D) Σ_j (1 - Π_{k<=j} α_k).
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, V = c.vocab_size, Tn = T_, D = D_;
    out.mtp_sum.assign(1, 0.0);
    out.mtp_count.assign(1, 0);
    std::vector<uint8_t> valid(Tn, 0);
    const int32_t* kcu = key_cu_seqlens(in_);
    for (int64_t d = 0; d < in_.num_docs; ++d)
        for (int64_t i = in_.cu_seqlens[d]; i < in_.cu_seqlens[d + 1]; ++i)
            valid[i] = key_row(in_, i) + D < kcu[d + 1];
    // Under CP the target rows i + k + 1 may be another rank's: every row's final hidden first.
    if (cp_) cp_gather_rows(in_, h_final_, h, h_final_keys_);
    const double row_w = sc.backward ? sc.mtp.at(0) : 0.0;
    for (int64_t k = 0; k < D; ++k)
        if (sc.backward) std::fill_n(dmtp_zk_[k], Tn * h, T(0));
    std::vector<double> dalpha(D);
    for (int64_t r0 = 0; r0 < Tn; r0 += chunk_rows_) {
        const int64_t n = std::min(chunk_rows_, Tn - r0);
        for (int64_t k = 0; k < D; ++k) {
            T* p = tv_p_ + k * chunk_rows_ * V;
            T* q = tv_q_ + k * chunk_rows_ * V;
            // Target rows i + k + 1 (depth index k is depth k+1); rows past the end are unused.
            const int64_t shift = k + 1, m = std::max<int64_t>(0, std::min(n, Tn - r0 - shift));
            std::fill_n(p, n * V, T(0));
            if (cp_) {
                // The chunk's target rows gathered (rows past the micro-batch stay 0: unused).
                for (int64_t r = 0; r < n; ++r) {
                    const int64_t g = key_row(in_, r0 + r) + shift;
                    T* dst = tv_rows_ + r * h;
                    if (g >= shift && g < Tk_)
                        std::copy_n(h_final_keys_ + g * h, h, dst);
                    else
                        std::fill_n(dst, h, T(0));
                }
                gemm<T>(false, true, n, V, h, 1, tv_rows_, h, param(head_), h, 0, p, V);
            } else if (m > 0) {
                gemm<T>(false, true, m, V, h, 1, h_final_ + (r0 + shift) * h, h, param(head_), h, 0,
                        p, V);
            }
            cpu::softmax_rows(p, n, V);
            gemm<T>(false, true, n, V, h, 1, mtp_acts_[k].hz + r0 * h, h, param(head_), h, 0, q, V);
            cpu::softmax_rows(q, n, V);
            cpu::tv_overlap(p, q, n, V, tv_alpha_ + k * Tn + r0);
        }
        for (int64_t r = 0; r < n; ++r) {
            const int64_t i = r0 + r;
            if (!valid[i]) continue;
            const cpu::TvChainRow chain = cpu::tv_chain_row(tv_alpha_ + i, Tn, D, row_w,
                                                            sc.backward ? dalpha.data() : nullptr);
            out.mtp_sum[0] += chain.loss;
            out.mtp_acceptance_sum += chain.accept;
            ++out.mtp_count[0];
            if (!sc.backward) continue;
            // dL/dz of each depth's draft logits, reusing q's storage.
            for (int64_t d = 0; d < D; ++d)
                cpu::tv_logit_grad_row(tv_p_ + (d * chunk_rows_ + r) * V,
                                       tv_q_ + (d * chunk_rows_ + r) * V, V, dalpha[d]);
        }
        if (!sc.backward) continue;
        for (int64_t k = 0; k < D; ++k) {
            T* dz = tv_q_ + k * chunk_rows_ * V;
            for (int64_t r = 0; r < n; ++r)
                if (!valid[r0 + r]) std::fill_n(dz + r * V, V, T(0));
            // Heads are detached under e2e_tv: no gradient into lm_head.
            gemm<T>(false, false, n, h, V, 1, dz, V, param(head_), h, 0, dmtp_zk_[k] + r0 * h, h);
        }
    }
}

template <typename T>
void Glm5Model<T>::mtp_backward(const LossScales& sc) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    // dmtp_h_: gradient of h^k flowing back from depth k+1 (through its hnorm input).
    std::fill_n(dmtp_h_, Tn * h, T(0));
    if (dmtp_kv_) std::fill_n(dmtp_kv_, Tn * (c.kv_lora_rank + c.qk_pos_emb_head_dim), T(0));
    for (int64_t k = D_ - 1; k >= 0; --k) {
        MtpActs& A = mtp_acts_[k];
        const MtpLayer& M = mtp_at(k);
        // dz: from this depth's loss (through the shared-head norm) plus from depth k+2.
        std::copy_n(dmtp_h_, Tn * h, dmtp_z_);
        cpu::rmsnorm_backward(dmtp_zk_[k], h, A.hout, h, param(M.norm), A.rstd_z, Tn, h, dmtp_z_, h,
                              true, grad(M.norm));
        M.layer->backward(A.layer, A.hin, dmtp_z_, in_, sc.aux, dmtp_kv_);  // dmtp_z_ = d h'
        linear_dgrad(fp8_, dmtp_z_, h, Tn, h, param(M.eh_proj), 2 * h, dmtp_cat_, 2 * h, false);
        linear_wgrad(fp8_, dmtp_z_, h, Tn, h, A.cat, 2 * h, 2 * h, grad(M.eh_proj));
        // Embedding half.
        cpu::rmsnorm_backward(dmtp_cat_, 2 * h, A.e, h, param(M.enorm), A.rstd_e, Tn, h, dmtp_e_, h,
                              false, grad(M.enorm));
        if (!c.mtp_detach_heads) {
            T* dE = grad(embed_);
            for (int64_t i = 0; i < Tn; ++i) {
                if (A.ids[i] < 0) continue;
                T* dst = dE + int64_t(A.ids[i]) * h;
                for (int64_t j = 0; j < h; ++j) dst[j] += dmtp_e_[i * h + j];
            }
        }
        // Hidden half: into h^{k-1} (the previous depth's layer output, or the final norm output).
        const T* prev = k > 0 ? mtp_acts_[k - 1].hout : h_final_;
        cpu::rmsnorm_backward(dmtp_cat_ + h, 2 * h, prev, h, param(M.hnorm), A.rstd_h, Tn, h,
                              dmtp_h_, h, false, grad(M.hnorm));
    }
    if (!c.mtp_detach_heads) cpu::add_inplace(dh_, dmtp_h_, Tn * h);
}

template <typename T>
void Glm5Model<T>::logits_row(int64_t row, T* out) const {
    ST_ASSERT(row >= 0 && row < T_, "row ", row);
    gemm<T>(false, true, 1, cfg_.vocab_size, cfg_.hidden_size, 1, h_final_ + row * cfg_.hidden_size,
            cfg_.hidden_size, param(head_), cfg_.hidden_size, 0, out, cfg_.vocab_size);
}

template <typename T>
void Glm5Model<T>::reset_moe_stats() {
    for (auto& l : layers_)
        if (l->moe()) {
            std::fill(l->moe()->stats().load.begin(), l->moe()->stats().load.end(), 0);
            l->moe()->stats().dropped = 0;
        }
    for (auto& m : mtp_layers_)
        if (m.layer->moe()) {
            std::fill(m.layer->moe()->stats().load.begin(), m.layer->moe()->stats().load.end(), 0);
            m.layer->moe()->stats().dropped = 0;
        }
}

template <typename T>
std::vector<std::vector<int64_t>> Glm5Model<T>::moe_loads() const {
    std::vector<std::vector<int64_t>> out;
    for (const auto& l : layers_)
        if (l->moe()) out.push_back(l->moe()->stats().load);
    return out;
}

template <typename T>
int64_t Glm5Model<T>::moe_dropped() const {
    int64_t n = 0;
    for (const auto& l : layers_)
        if (l->moe()) n += l->moe()->stats().dropped;
    for (const auto& m : mtp_layers_)
        if (m.layer->moe()) n += m.layer->moe()->stats().dropped;
    return n;
}

template <typename T>
std::vector<int64_t> Glm5Model<T>::moe_stats_flat() const {
    std::vector<int64_t> flat;
    auto add = [&](const DecoderLayer<T>* l) {
        if (!l || !const_cast<DecoderLayer<T>*>(l)->moe()) return;
        auto& st = const_cast<DecoderLayer<T>*>(l)->moe()->stats();
        flat.insert(flat.end(), st.load.begin(), st.load.end());
        flat.push_back(st.dropped);
    };
    for (const auto& l : layers_) add(l.get());
    for (const auto& m : mtp_layers_) add(m.layer.get());
    return flat;
}

template <typename T>
void Glm5Model<T>::set_moe_stats_flat(const std::vector<int64_t>& flat) {
    size_t at = 0;
    auto take = [&](DecoderLayer<T>* l) {
        if (!l || !l->moe()) return;
        auto& st = l->moe()->stats();
        ST_ASSERT(at + st.load.size() + 1 <= flat.size(), "moe stats size");
        std::copy_n(flat.begin() + at, st.load.size(), st.load.begin());
        at += st.load.size();
        st.dropped = flat[at++];
    };
    for (auto& l : layers_) take(l.get());
    for (auto& m : mtp_layers_) take(m.layer.get());
    ST_ASSERT(at == flat.size(), "moe stats size");
}

template <typename T>
void Glm5Model<T>::set_expert_parallel(Comm* ep) {
    for (auto& l : layers_)
        if (l->moe()) l->moe()->set_expert_parallel(ep);
    for (auto& m : mtp_layers_)
        if (m.layer->moe()) m.layer->moe()->set_expert_parallel(ep);
}

template <typename T>
void Glm5Model<T>::set_fp8_blockwise(bool on) {
    fp8_ = on;
    for (auto& l : layers_) l->set_fp8(on);
    for (MtpLayer& m : mtp_layers_) m.layer->set_fp8(on);
}

template <typename T>
void Glm5Model<T>::set_context_parallel(Comm* cp) {
    ST_CHECK(cp_ || !cp || cp->size() == 1, "context parallelism over ", cp ? cp->size() : 1,
             " ranks, but the model was planned without it");
    in_.cp = cp_ ? cp : nullptr;
}

template <typename T>
void Glm5Model<T>::update_router_bias(double rate) {
    for (auto& l : layers_)
        if (l->moe()) l->moe()->update_bias(rate);
    for (auto& m : mtp_layers_)
        if (m.layer->moe()) m.layer->moe()->update_bias(rate);
}

template class Glm5Model<float>;
template class Glm5Model<double>;

}  // namespace sparsetron
