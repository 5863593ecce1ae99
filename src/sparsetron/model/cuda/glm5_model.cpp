#include "sparsetron/model/cuda/glm5_model.h"

#include <algorithm>
#include <cstring>

#include "sparsetron/model/cuda/cp_keys.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/loss/loss.h"
#include "sparsetron/ops/norm/norm.h"
#include "sparsetron/parallel/context/cp_shard.h"

namespace sparsetron::cuda {

using cuda::gemm;

namespace {

// The stages a model holds: the whole model when none is given.
std::vector<PipelineStage> model_chunks(const std::vector<PipelineStage>& stages) {
    return stages.empty() ? std::vector<PipelineStage>{PipelineStage{}} : stages;
}

}  // namespace

CudaGlm5Model::CudaGlm5Model(const ModelConfig& cfg, const ParamStore& host_store, MemoryPlan& plan,
                             int64_t tokens, int64_t max_docs, int64_t chunk_rows,
                             int64_t key_tokens, bool fp8_blockwise,
                             const std::vector<PipelineStage>& stages,
                             const MasterPlacement& masters)
    : cfg_(cfg),
      plan_(plan),
      stages_(model_chunks(stages)),
      first_(stages_.front().first()),
      last_(stages_.back().last()),
      B_(plan),
      T_(tokens),
      max_docs_(max_docs),
      chunk_rows_(std::min(chunk_rows, tokens)),
      cp_(key_tokens > 0),
      Tk_(key_tokens > 0 ? key_tokens : tokens) {
    if (cp_) require_dsa_for_context_parallel(cfg);
    ST_CHECK(masters.owner.empty() || masters.owner.size() == host_store.params().size(),
             "CUDA model: ", masters.owner.size(), " master placements for ",
             host_store.params().size(), " parameters");
    // The masters are planned last, once the modules have said which they read.
    store_ = std::make_unique<ParamStore>(plan, DType::F32, /*plan_values=*/false);
    for (const auto& p : host_store.params())
        store_->add_like(p, masters.bf16_gradients && bf16_gradient_allowed(p.name));
    P_ = std::make_unique<CudaParams>(*store_);
    const int64_t h = cfg.hidden_size, Tn = tokens, V = cfg.vocab_size;
    const int64_t maxdim =
        std::max({h, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.dsa_indexer_head_dim});
    B_.scratch(S_.norm_ws, "norm.weight_grad_partials", {2 * ((Tn + 63) / 64) * maxdim});
    S_.max_docs = max_docs;
    if (cfg.moe_paged_stash && moe_stash_bound(cfg, tokens, stages_).applications > 0) {
        stash_ = std::make_unique<MoeStash>(cfg, B_, tokens, CudaMoeLayer::stash_row_width(cfg),
                                            stages_);
        S_.moe_stash = stash_.get();
    }
    if (fp8_blockwise) {
        fp8_ = std::make_unique<Fp8Weights>(*P_, B_, tokens);
        S_.fp8 = fp8_.get();
    }
    in_.tokens = Tn;
    in_.key_tokens = Tk_;
    for (size_t c = 0; c < stages_.size(); ++c) {
        const PipelineStage& st = stages_[c];
        const int64_t b = st.first_layer, e = st.end_layer < 0 ? cfg.num_layers : st.end_layer;
        ST_CHECK(
            0 <= b && b < e && e <= cfg.num_layers &&
                (st.whole() || (st.first() == (b == 0) && st.last() == (e == cfg.num_layers))) &&
                (c == 0 || st.index > stages_[c - 1].index),
            "pipeline stage ", st.index, " of ", st.count, " holds layers [", b, ", ", e, ") of ",
            cfg.num_layers);
        chunk_begin_.push_back(int64_t(layer_id_.size()));
        for (int64_t l = b; l < e; ++l) layer_id_.push_back(l), chunk_of_.push_back(int(c));
    }
    chunk_begin_.push_back(int64_t(layer_id_.size()));
    const bool last = last_;
    // The embedding on the first stage (and its copy on the last when MTP reads it); the final
    // norm and the head on the last.
    embed_ = host_store.index_of("model.embed_tokens.weight");
    ST_CHECK(!first_ || embed_ >= 0, "the first stage has no embedding");
    if (last) {
        final_norm_ = P_->index("model.norm.weight");
        head_ = P_->index("lm_head.weight");
    }
    D_ = last ? cfg.mtp_num_layers : 0;
    const int64_t n_layers = int64_t(layer_id_.size());
    x_.assign(size_t(n_layers + int64_t(stages_.size())), nullptr);
    if (cfg.fine_grained_activation_offloading) {
        // The layer applications in forward order: this rank's layers, then MTP depths.
        std::vector<std::string> apps;
        for (const int64_t l : layer_id_) apps.push_back(cat("layers.", l));
        for (int64_t k = 1; k <= D_; ++k) apps.push_back(cat("mtp.depth", k));
        offload_ = std::make_unique<ActivationOffload>(plan, std::move(apps));
        B_.set_offload(offload_.get());
    }
    int64_t indexer_apps = 0;
    for (int64_t i = 0; i < n_layers; ++i) {
        const int64_t l = layer_id_[size_t(i)];
        layers_.push_back(
            std::make_unique<CudaDecoderLayer>(cfg_, *P_, B_, S_, l, tokens, key_tokens));
        acts_.push_back(std::make_unique<CudaDecoderLayer::Acts>());
        B_.set_application(i);
        layers_.back()->declare(*acts_.back(), B_, cat("layers.", l, "."));
        B_.set_application(-1);
        B_.act(x_[size_t(x_at(i))], cat("layers.", l, ".x_in"), {Tn, h});
        indexer_apps += layers_.back()->has_indexer();
        // A chunk's output: the next stage's input rows.
        if (i + 1 == n_layers || chunk_of_[size_t(i + 1)] != chunk_of_[size_t(i)])
            B_.act(
                x_[size_t(x_at(i) + 1)],
                last && i + 1 == n_layers ? std::string("final.x") : cat("layers.", l + 1, ".x_in"),
                {Tn, h});
    }
    B_.scratch(dx_, "grad.residual", {Tn, h});
    if (last) {
        B_.act(h_final_, "final.norm_out", {Tn, h});
        B_.act(rstd_final_, "final.norm_rstd", {Tn});
        B_.scratch(dh_, "grad.final_norm_out", {Tn, h});
        B_.scratch(logits_, "head.logits_chunk", {chunk_rows_, V});
        // Some chunks' dlogits: the head's weight gradient takes one GEMM per that many rows
        // (head_cross_entropy), so the buffer is bounded by the hidden size, not the
        // micro-batch. Live only inside the head's and MTP's losses, between the forward and the
        // backward: it shares a region with attention backward gradients (CudaMlaAttention), as
        // the draft rows do.
        B_.in_region(dlogits_, "grad.attn.q_absorbed | grad.attn.o | head.dlogits",
                     {cuda::head_dlogits_rows(T_, chunk_rows_, cfg.hidden_size), V});
        B_.scratch(row_loss_, "head.row_loss", {Tn});
        if (fp8_ && cfg.fp8_output_proj) {
            head_fp8_on_ = true;
            head8_.rows = V, head8_.cols = h;
            B_.param_copy(head8_.block, "lm_head.weight.fp8", {head8_.bytes()});
            const HeadFp8Scratch f = head_fp8_scratch(
                chunk_rows_, cuda::head_dlogits_rows(T_, chunk_rows_, cfg.hidden_size), h, V);
            B_.scratch(head_fp8_.qa, "head.fp8_operand_a", {f.qa});
            B_.scratch(head_fp8_.qb, "head.fp8_operand_b", {f.qb});
            B_.scratch(head_fp8_.sa, "head.fp8_operand_a_scales", {f.sa});
            B_.scratch(head_fp8_.sb, "head.fp8_operand_b_scales", {f.sb});
        }
    }
    if (D_ > 0) {
        for (int64_t j = 0; j < cfg.mtp_physical_layers(); ++j) {
            const int64_t l = cfg.num_layers + j;
            const std::string p = cat("model.layers.", l, ".");
            MtpLayer m;
            m.enorm = P_->index(p + "enorm.weight");
            m.hnorm = P_->index(p + "hnorm.weight");
            m.eh_proj = P_->index(p + "eh_proj.weight");
            if (fp8_) m.feh = fp8_->add(m.eh_proj);
            m.norm = P_->index(p + "shared_head.norm.weight");
            m.layer = std::make_unique<CudaDecoderLayer>(cfg_, *P_, B_, S_, l, tokens, key_tokens);
            mtp_layers_.push_back(std::move(m));
        }
        for (int64_t k = 1; k <= D_; ++k) {
            const std::string a = cat("mtp.depth", k, ".");
            auto m = std::make_unique<MtpActs>();
            B_.scratch(m->e, "mtp.embedding", {Tn, h});
            B_.act(m->rstd_e, a + "enorm_rstd", {Tn});
            B_.act(m->rstd_h, a + "hnorm_rstd", {Tn});
            B_.scratch(m->cat, "mtp.concat", {Tn, 2 * h});
            B_.act(m->hin, a + "layer_in", {Tn, h});
            B_.act(m->hout, a + "layer_out", {Tn, h});
            B_.act(m->rstd_z, a + "head_norm_rstd", {Tn});
            B_.scratch(m->dzk, cat("grad.mtp.head_norm_out.", k), {Tn, h});
            const CudaDecoderLayer& layer = *mtp_at(k - 1).layer;
            B_.set_application(stage_layers() + k - 1);
            layer.declare(m->layer, B_, a);
            B_.set_application(-1);
            if (layer.has_indexer() && !(kv_share() && k > 1)) ++indexer_apps;
            mtp_.push_back(std::move(m));
        }
        if (kv_share())
            B_.scratch(dmtp_kv_, "grad.mtp.k_latent_shared",
                       {Tn, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim});
        B_.scratch(dmtp_h_, "grad.mtp.hidden", {Tn, h});
        B_.scratch(dmtp_cat_, "grad.mtp.concat", {Tn, 2 * h});
        B_.scratch(dmtp_z_, "grad.mtp.layer_out", {Tn, h});
        B_.scratch(dmtp_e_, "grad.mtp.embedding", {Tn, h});
        B_.scratch(mtp_hz_, "mtp.head_norm_out",
                   {cfg.mtp_loss_type == "e2e_tv" ? std::min(Tn, chunk_rows_) : Tn, h});
        if (cfg.mtp_loss_type == "e2e_tv") {
            // Depth k's targets are the main head's rows shifted by k + 1: without CP one block
            // of chunk + D - 1 rows serves every depth (SPEC §8 counts the target logits once);
            // under CP a depth's target rows are gathered from the group, a block per depth.
            tv_per_depth_ = cp_;
            B_.scratch(tv_p_, "mtp.tv.target_probs", {tv_target_rows(), V});
            B_.in_region(tv_q_, "grad.attn.o_latent | grad.attn.q | mtp.tv.draft_probs",
                         {D_, chunk_rows_, V});
            B_.scratch(tv_alpha_, "mtp.tv.alpha", {D_, Tn});
            B_.scratch(tv_below_, "mtp.tv.draft_below_target_sum", {D_, Tn});
            B_.scratch(tv_dalpha_, "mtp.tv.dalpha", {D_, Tn});
            if (cp_) {
                B_.act(h_final_keys_, "mtp.tv.final_norm_out_all_rows", {Tk_, h});
                // bf16 rows only (no gradient goes back): half the exchange's fp32 floats.
                B_.scratch(h_final_xfer_, "mtp.tv.cp_rows_exchange",
                           {(cp_key_exchange_floats(cfg, Tn, h) + 1) / 2});
                B_.scratch(tv_rows_, "mtp.tv.target_rows", {chunk_rows_, h});
            }
        }
    }
    tv_at_ = 2 + 2 * std::max<int64_t>(D_, 1);
    aux_at_ = tv_at_ + 2;
    idx_at_ = aux_at_ + 2;
    n_sums_ = idx_at_ + 2 * std::max<int64_t>(indexer_apps, 1);
    B_.act(sums_, "loss.sums", {n_sums_});
    // Every per-micro-batch input in one block (layout in carve_inputs()): one upload per
    // micro-batch, one device copy per micro-batch inside a captured step.
    n_scales_ = 2 + std::max<int64_t>(D_, 1);
    input_words_ = (5 + 2 * D_) * Tn + n_scales_ + doc_words() + (Tn + 3) / 4;
    B_.act(in_block_, "inputs.block", {input_words_});
    if (cp_) B_.act(all_key_rows_, "inputs.cp_all_key_rows", {cfg.context_parallel_ranks * Tn});
    B_.plan_regions();
    if (offload_) offload_->plan();
    // The weights read only through FP8 have no bf16 copies; the FP8 quantizers read their
    // masters, but for the linears gathered in FP8 from their owners.
    if (fp8_ && masters.fp8_gather)
        fp8_->gather_from_owners([&](int64_t i) { return masters.sharded(i); });
    if (fp8_) fp8_->declare();
    const std::vector<int64_t> fp8_params = fp8_ ? fp8_->params() : std::vector<int64_t>{};
    if (fp8_)
        for (const int64_t i : fp8_->quantized_here()) P_->read_master(i);
    if (head_fp8_on_) {
        // The head's FP8 copy is quantized here from its whole master.
        ST_CHECK(!masters.split(head_),
                 "fp8_output_proj quantizes the output layer from its fp32 master, which the "
                 "distributed optimizer splits by rows over ",
                 masters.ranks, " ranks here: run it without use_distributed_optimizer");
        P_->read_master(head_);
    }
    // Optimizer offload: the masters this rank updates, in parameter order, while their bytes
    // stay within the fraction; not a master every rank keeps under the distributed optimizer
    // (its owner broadcasts it over NCCL, from device memory), nor one a GEMM reads (routers).
    std::vector<bool> eligible(size_t(store_->size()), false);
    double eligible_bytes = 0;
    const auto master_bytes = [&](int64_t i) {
        const double n = double(store_->params()[size_t(i)].numel());
        return 4.0 * (masters.split(i) ? n / double(masters.ranks) : n);
    };
    for (int64_t i = 0; i < store_->size(); ++i) {
        const ParamInfo& p = store_->params()[size_t(i)];
        eligible[size_t(i)] = masters.host_fraction > 0 && p.trainable && !p.pipeline_copy &&
                              masters.here(i) && !(masters.sharded(i) && P_->master_read(i)) &&
                              !P_->master_read_by_gemm(i);
        if (eligible[size_t(i)]) eligible_bytes += master_bytes(i);
    }
    double on_host = 0;
    for (int64_t i = 0; i < store_->size(); ++i) {
        if (!eligible[size_t(i)] ||
            on_host + master_bytes(i) > masters.host_fraction * eligible_bytes * (1 + 1e-12))
            continue;
        on_host += master_bytes(i);
        P_->set_master_on_host(i);
    }
    for (int64_t i = 0; i < store_->size(); ++i) {
        const MemClass where = P_->master_on_host(i) ? MemClass::HostOffload : MemClass::Parameters;
        if (masters.split(i)) {
            // This rank's rows of the master (the optimizer's row share, owner_assignment.h).
            ST_ASSERT(!P_->master_read(i), "the master of '", store_->params()[size_t(i)].name,
                      "' is read whole but split by rows");
            const int64_t rows = store_->params()[size_t(i)].shape[0] / masters.ranks;
            P_->plan_master_rows(plan, i, masters.rank * rows, rows, where);
        } else if (masters.here(i) || P_->master_read(i)) {
            store_->plan_value(i, where);
        }
    }
    // With fp8_output_proj the head's bf16 copy is read only by the e2e TV loss's logits.
    std::vector<int64_t> unread = fp8_params;
    if (head_fp8_on_ && !(D_ > 0 && cfg.mtp_loss_type == "e2e_tv")) unread.push_back(head_);
    P_->plan_bf16(plan, unread);
}

void CudaGlm5Model::carve_inputs() {
    const int64_t Tn = T_;
    int32_t* w = in_block_;
    in_.token_ids = w, in_.targets = w + Tn, in_.positions = w + 2 * Tn, in_.row_begin = w + 3 * Tn;
    w += 4 * Tn;
    (cp_ ? in_.key_row : in_.rows) = w, w += Tn;
    for (auto& m : mtp_) m->ids = w, m->targets = w + Tn, w += 2 * Tn;
    in_.loss_scales = reinterpret_cast<const float*>(w);
    w += n_scales_;
    in_.docs = max_docs_, in_.doc_rows = w, w += max_docs_ + 1;
    in_.doc_fscale = reinterpret_cast<const float*>(w), w += max_docs_;
    in_.doc_weight = reinterpret_cast<const float*>(w), w += max_docs_;
    tv_valid_ = tv_p_ ? reinterpret_cast<uint8_t*>(w) : nullptr;
}

CudaGlm5Model::~CudaGlm5Model() = default;

int64_t CudaGlm5Model::local_layer(int64_t layer) const {
    const auto it = std::find(layer_id_.begin(), layer_id_.end(), layer);
    return it == layer_id_.end() ? -1 : int64_t(it - layer_id_.begin());
}

void CudaGlm5Model::bind(const ExecContext& ctx) {
    P_->bind(plan_);
    B_.resolve();
    if (fp8_) fp8_->bind(*P_);
    if (head_fp8_on_) {
        head_fp8_.w = {head8_.q(), head8_.s(), true};
        head_fp8_.wt = {head8_.qt(), head8_.st(), true};
    }
    if (offload_) offload_->bind(ctx);
    carve_inputs();
    in_.all_key_rows = all_key_rows_;
    // IndexShare: shared layers attend over their source layer's top-k; the indexer sums slots.
    int64_t slot = 0;
    idx_sums_.clear();
    idx_layers_.clear();
    for (size_t l = 0; l < layers_.size(); ++l) {
        CudaDecoderLayer::Acts& A = *acts_[l];
        if (layers_[l]->has_indexer()) {
            A.topk = A.idx.topk, A.topk_len = A.idx.len;
            A.indexer_sums = sums_ + idx_at_ + 2 * slot++;
            idx_sums_.push_back(A.indexer_sums);
            idx_layers_.push_back(layer_id_[l]);
        }
    }
    // The source layer is an earlier layer of the same chunk (check_index_share_pipeline_split).
    for (size_t l = 0; l < layers_.size(); ++l) {
        CudaDecoderLayer::Acts& A = *acts_[l];
        const int64_t layer0 = layer_id_[l];
        if (!cfg_.uses_dsa() || A.topk) continue;
        const int64_t src = dsa_source_layer(cfg_, layer0), i = local_layer(src);
        ST_CHECK(i >= 0 && src < layer0 && chunk_of_[size_t(i)] == chunk_of_[l] &&
                     acts_[size_t(i)]->topk,
                 "DSA layer ", layer0, " shares the top-k of layer ", src,
                 ", which this stage does not compute");
        A.topk = acts_[size_t(i)]->topk, A.topk_len = acts_[size_t(i)]->topk_len;
    }
    for (int64_t k = 0; k < D_; ++k) {
        CudaDecoderLayer::Acts& A = mtp_[k]->layer;
        if (kv_share() && k > 0) {
            const CudaDecoderLayer::Acts& first = mtp_[0]->layer;
            A.attn.kabs_shared = first.attn.kkeys ? first.attn.kkeys : first.attn.kabs;
            A.topk = first.topk, A.topk_len = first.topk_len;
            A.skip_indexer = true;
        } else if (mtp_at(k).layer->has_indexer()) {
            A.topk = A.idx.topk, A.topk_len = A.idx.len;
            A.indexer_sums = sums_ + idx_at_ + 2 * slot++;
            idx_sums_.push_back(A.indexer_sums);
            idx_layers_.push_back(cfg_.num_layers + k);
        }
    }
    // The MoE sequence aux loss's sums: the backbone's layers, the MTP layer's applications.
    for (auto& A : acts_) A->moe.aux_sum = sums_ + aux_at_;
    for (auto& M : mtp_) M->layer.moe.aux_sum = sums_ + aux_at_ + 1;
    for (CudaMoeLayer* m : moes()) m->check_layout();
    reset_moe_stats(ctx);
}

void CudaGlm5Model::set_context_parallel(Comm* cp) {
    ST_CHECK(cp_ || !cp || cp->size() == 1, "context parallelism over ", cp ? cp->size() : 1,
             " ranks, but the model was planned without it");
    ST_CHECK(!cp || cp->size() == 1 || cp->on_device(),
             "CUDA context parallelism needs device collectives (NCCL); the ", cp ? cp->name() : "",
             " communicator has none");
    in_.cp = cp_ ? cp : nullptr;
}

void CudaGlm5Model::set_moe_redo(bool on) {
    redo_ = on;
    if (stash_) stash_->set_bypass(on);
    for (CudaMoeLayer* m : moes()) m->set_redo(on);
}

void CudaGlm5Model::set_expert_exchange(cuda::ExpertExchange* ep) {
    for (CudaMoeLayer* m : moes()) m->set_exchange(ep);
}

std::vector<CudaMoeLayer*> CudaGlm5Model::moes() const {
    std::vector<CudaMoeLayer*> out;
    for (const auto& l : layers_)
        if (l->moe()) out.push_back(l->moe());
    for (const auto& m : mtp_layers_)
        if (m.layer->moe()) out.push_back(m.layer->moe());
    return out;
}

void CudaGlm5Model::pack_inputs(const MicroBatch& mb, const LossScales& sc,
                                std::vector<int32_t>& out) const {
    ST_CHECK(mb.capacity == Tk_ && mb.max_documents == max_docs_, "micro-batch of ", mb.capacity,
             " slots / ", mb.max_documents, " documents does not match the plan (", Tk_, " / ",
             max_docs_, ")");
    for (int64_t i = 0; i < Tk_; ++i)
        ST_CHECK(mb.tokens[i] >= 0 && mb.tokens[i] < cfg_.vocab_size, "token id ", mb.tokens[i],
                 " is outside the vocabulary (vocab_size ", cfg_.vocab_size, ")");
    const int64_t Tn = T_;
    out.assign(size_t(input_words_), 0);
    int32_t* w = out.data();
    int32_t *tok = w, *tgt = w + Tn, *pos = w + 2 * Tn, *row_begin = w + 3 * Tn;
    int32_t* key_row = w + 4 * Tn;  // CudaInputs::key_row under CP, else CudaInputs::rows
    int32_t* mtp = w + 5 * Tn;      // per depth: input ids [Tn], targets [Tn]
    std::fill_n(tgt, Tn, -1);
    std::fill_n(row_begin, Tn, -1);
    std::fill_n(key_row, Tn, -1);
    std::fill_n(mtp, 2 * D_ * Tn, -1);
    const int64_t scales_at = 5 * Tn + 2 * D_ * Tn;
    const int64_t docs_at = scales_at + n_scales_;
    uint8_t* valid = tv_p_ ? reinterpret_cast<uint8_t*>(w + docs_at + doc_words()) : nullptr;
    // The documents' rows of this rank, and the sequence aux loss's weights (CudaInputs).
    int32_t* doc_rows = w + docs_at;
    float* doc_fscale = reinterpret_cast<float*>(doc_rows + max_docs_ + 1);
    float* doc_weight = doc_fscale + max_docs_;
    // This rank's rows: every row of the micro-batch, or under CP its two chunks of every
    // document. Row n is micro-batch row g of the document [b, e).
    const int cp = cp_ && in_.cp ? in_.cp->size() : 1, rank = cp_ && in_.cp ? in_.cp->rank() : 0;
    int64_t n = 0;
    const double aux = sc.aux * cfg_.moe_aux_loss_coeff;
    for (int64_t d = 0; d < mb.num_documents; ++d) {
        const int64_t b = mb.cu_seqlens[d], e = mb.cu_seqlens[d + 1];
        doc_rows[d] = int32_t(n);
        if (e > b) {
            doc_fscale[d] =
                float(double(cfg_.num_experts) / (double(cfg_.moe_router_topk) * double(e - b)));
            doc_weight[d] = float(aux / double(mb.num_documents) / double(e - b));
        }
        const std::vector<RowRange> ranges =
            cp_ ? cp_rows(e - b, cp, rank) : std::vector<RowRange>{RowRange{0, e - b}};
        for (const RowRange& rr : ranges)
            for (int64_t i = rr.begin; i < rr.end; ++i, ++n) {
                ST_CHECK(n < Tn, "CP rank ", rank, " holds more than the ", Tn,
                         " rows it was planned for");
                const int64_t g = b + i;
                tok[n] = mb.tokens[g], tgt[n] = mb.targets[g], pos[n] = mb.positions[g];
                row_begin[n] = int32_t(b);
                key_row[n] = int32_t(g);
                // MTP: depth k reads the token at row g+k and predicts row g+k+1, inside the
                // document only (under CP those rows may be another rank's).
                for (int64_t k = 1; k <= D_; ++k) {
                    int32_t* ids = mtp + 2 * (k - 1) * Tn;
                    if (g + k < e) ids[n] = mb.tokens[g + k];
                    if (g + k + 1 < e) ids[Tn + n] = mb.tokens[g + k + 1];
                }
                if (valid && g + D_ < e) valid[n] = 1;
            }
    }
    for (int64_t d = mb.num_documents; d <= max_docs_; ++d) doc_rows[d] = int32_t(n);
    // Loss scales (see CudaInputs::loss_scales); 0 where the step has no backward. The indexer's
    // KL is divided by the micro-batch's real rows (every CP rank's: its mean), or by the global
    // batch's tokens under per-token loss.
    const int64_t real_rows =
        sc.indexer_tokens > 0 ? sc.indexer_tokens : mb.cu_seqlens[mb.num_documents];
    float scales[64] = {};
    ST_ASSERT(n_scales_ <= 64, "loss scales");
    if (sc.backward) {
        scales[0] = float(sc.lm);
        for (size_t k = 0; k < sc.mtp.size() && int64_t(k) + 2 < n_scales_; ++k)
            scales[2 + k] = float(sc.mtp[k]);
    }
    if ((sc.backward || sc.indexer_grads) && real_rows > 0)
        scales[1] = float(sc.indexer * cfg_.dsa_indexer_loss_coeff / double(real_rows));
    std::memcpy(w + scales_at, scales, size_t(n_scales_) * sizeof(float));
}

void CudaGlm5Model::load_inputs(const ExecContext& ctx, const MicroBatch& mb,
                                const LossScales& sc) {
    stage_inputs(ctx, mb, sc, in_block_);
}

void CudaGlm5Model::stage_inputs(const ExecContext& ctx, const MicroBatch& mb, const LossScales& sc,
                                 int32_t* dst) {
    pack_inputs(mb, sc, h_block_);
    cuda::upload(ctx, dst, h_block_.data(), input_words_ * int64_t(sizeof(int32_t)));
    indexer_tokens_ = sc.indexer_tokens;  // the step's, the same for each of its micro-batches
    if (dst == in_block_) {
        in_.real_rows = mb.cu_seqlens[mb.num_documents];
        last_tv_rows_ = tv_rows(mb);
        last_real_rows_ = in_.real_rows;
    }
}

void CudaGlm5Model::copy_inputs_from(const ExecContext& ctx, const int32_t* src) {
    cuda::copy_2d(ctx, in_block_, 0, src, 0, input_words_ * int64_t(sizeof(int32_t)), 1);
}

void CudaGlm5Model::copy_inputs_from_slot(const ExecContext& ctx, const int32_t* slots,
                                          const int32_t* index) {
    cuda::copy_from_slot(ctx, in_block_, slots, input_words_ * int64_t(sizeof(int32_t)), index);
}

void CudaGlm5Model::enqueue(const ExecContext& ctx, const LossScales& sc) {
    enqueue_forward(ctx, sc);
    if (sc.backward) enqueue_backward(ctx, sc);
}

void CudaGlm5Model::enqueue_forward(const ExecContext& ctx, const LossScales& sc, bool recompute,
                                    bool kept, int chunk) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    ST_ASSERT(kept || !recompute, "a recomputed forward is run for its backward");
    ST_ASSERT(chunk >= 0 && chunk < int(stages_.size()), "forward of chunk ", chunk, " of ",
              stages_.size());
    const bool embeds = first_ && chunk == 0, heads = last_ && chunk + 1 == int(stages_.size());
    in_.recompute = recompute;
    if (in_.cp && in_.cp->size() > 1) {
        // Every rank's key rows, for the key exchange (cp_keys.h).
        ST_ASSERT(in_.cp->size() <= cfg_.context_parallel_ranks, "a CP group of ", in_.cp->size(),
                  " ranks, planned for ", cfg_.context_parallel_ranks);
        const int64_t bytes = Tn * int64_t(sizeof(int32_t));
        cuda::copy_2d(ctx, all_key_rows_ + in_.cp->rank() * Tn, 0, in_.key_row, 0, bytes, 1);
        in_.cp->device_allgather(all_key_rows_, bytes, ctx.stream);
    }
    // What the backward reads is saved only when it follows: a forward-only pass or a discarded
    // forward pushes no stash pages (the backward pops those of the forward run again) and
    // offloads nothing.
    const bool saves = kept && sc.backward;
    struct Bypass {
        MoeStash* stash;
        bool was;
        ~Bypass() {
            if (stash) stash->set_bypass(was);
        }
    } bypass{saves ? nullptr : stash_.get(), stash_ && stash_->bypassed()};
    if (bypass.stash) bypass.stash->set_bypass(true);
    if (!recompute) cuda::zero(ctx, sums_, n_sums_ * sizeof(double));
    if (stash_) stash_->reset(ctx, /*new_step=*/false);
    // The FP8 weights follow the masters: quantized per micro-batch (cheap next to the GEMMs;
    // the masters change only between steps), but for those the optimizer gathers from their
    // owners after each update.
    // A step's first forward on a rank is its first chunk's.
    if (fp8_ && chunk == 0) fp8_->quantize(ctx);
    if (head_fp8_on_ && heads) quantize_fp8_copy(ctx, (*P_)[head_].master, head8_);
    if (embeds) cuda::embedding_forward(ctx, in_.token_ids, Tn, (*P_)[embed_].w, h, x_[0]);
    const float idx_gs = sc.backward || sc.indexer_grads ? float(sc.indexer) : 0.f;
    // Activation offload's schedule around each layer application (steps with a backward).
    ActivationOffload* off = saves ? offload_.get() : nullptr;
    for (size_t l = size_t(chunk_begin_[size_t(chunk)]);
         l < size_t(chunk_begin_[size_t(chunk) + 1]); ++l) {
        if (off) off->before_forward(int64_t(l));
        const size_t x = size_t(x_at(int64_t(l)));
        graph_chunk(
            cat("forward ", l, recompute ? " recomputed" : "", saves ? " saving" : "", " ", idx_gs),
            [&] { layers_[l]->forward(ctx, *acts_[l], x_[x], x_[x + 1], in_, idx_gs); });
        if (off) off->after_forward(int64_t(l));
    }
    in_.recompute = false;
    if (!heads) return;
    const auto tail = [&] {
        cuda::rmsnorm_forward(ctx, x_.back(), h, (*P_)[final_norm_].w, Tn, h, float(c.norm_epsilon),
                              h_final_, h, rstd_final_);
        cuda::head_cross_entropy(ctx,
                                 head_loss(h_final_, in_.targets, in_.loss_scales,
                                           sc.backward ? P_->grad_beta(head_) : 1.f),
                                 row_loss_, sc.backward ? dh_ : nullptr,
                                 sc.backward ? (*P_)[head_].grad_out() : nullptr);
        cuda::loss_sum(ctx, row_loss_, in_.targets, Tn, sums_);
        if (D_ > 0) mtp_forward(ctx, sc, off);
    };
    // The head and MTP as one chunk, but with the MTP layer's offload copies between its parts.
    if (off && D_ > 0)
        tail();
    else
        graph_chunk(cat("head forward", sc.backward ? " backward" : "", saves ? " saving" : "",
                        sc.indexer_grads ? " indexer" : "", " mtp ", sc.mtp.size(), " ", idx_gs),
                    tail);
}

void CudaGlm5Model::graph_chunk(const std::string& key,
                                const std::function<void()>& enqueue) const {
    if (chunks_ && !redo_)
        chunks_->run(cat(key, " cp ", static_cast<const void*>(in_.cp)), enqueue);
    else
        enqueue();
}

void CudaGlm5Model::enqueue_backward(const ExecContext& ctx, const LossScales&, int chunk) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    ST_ASSERT(chunk >= 0 && chunk < int(stages_.size()), "backward of chunk ", chunk, " of ",
              stages_.size());
    const bool embeds = first_ && chunk == 0, heads = last_ && chunk + 1 == int(stages_.size());
    ActivationOffload* off = offload_.get();
    auto point = [&](int p) {
        if (hook_) hook_(p);
    };
    if (heads) {
        if (D_ > 0) {
            if (off)
                mtp_backward(ctx, off);
            else
                graph_chunk("mtp backward", [&] { mtp_backward(ctx, nullptr); });
        }
        point(0);
        cuda::rmsnorm_backward(ctx, dh_, h, x_.back(), h, (*P_)[final_norm_].w, rstd_final_, Tn, h,
                               dx_, h, false, P_->grad_to_add(ctx, final_norm_), S_.norm_ws);
    }
    if (chunk + 1 == int(stages_.size())) point(1);
    const int64_t n = stage_layers();
    for (int64_t l = chunk_begin_[size_t(chunk) + 1] - 1; l >= chunk_begin_[size_t(chunk)]; --l) {
        if (off) off->before_backward(l);
        graph_chunk(cat("backward ", l), [&] {
            layers_[size_t(l)]->backward(ctx, *acts_[size_t(l)], x_[size_t(x_at(l))], dx_, in_,
                                         nullptr);
        });
        if (off) off->after_backward(l);
        point(int(2 + n - 1 - l));
    }
    if (embeds)
        cuda::embedding_backward(ctx, in_.token_ids, Tn, dx_, h, P_->grad_to_add(ctx, embed_));
    if (chunk == 0) point(int(2 + n));
}

int CudaGlm5Model::backward_point(const std::string& name) const {
    const int64_t L = cfg_.num_layers, n = stage_layers();
    if (name == "lm_head.weight") return 0;
    if (name == "model.norm.weight") return 1;
    const std::string layers = "model.layers.";
    if (name.rfind(layers, 0) == 0) {
        const int64_t l = std::stoll(name.substr(layers.size()));
        if (l == L) return 0;  // the MTP layer (and its enorm, hnorm, eh_proj, head norm)
        if (const int64_t i = local_layer(l); i >= 0) return int(2 + n - 1 - i);
    }
    return int(2 + n);  // the embedding, and anything not named above: after the whole backward
}

LossSums CudaGlm5Model::read_losses(const ExecContext& ctx) const {
    std::vector<double> s(n_sums_);
    cuda::download(ctx, s.data(), sums_, n_sums_ * int64_t(sizeof(double)));
    return losses_from(s.data(), last_tv_rows_, last_real_rows_);
}

LossSums CudaGlm5Model::losses_from(const double* sums, const MicroBatch& mb) const {
    return losses_from(sums, tv_rows(mb), mb.cu_seqlens[mb.num_documents]);
}

int64_t CudaGlm5Model::tv_rows(const MicroBatch& mb) const {
    int64_t rows = 0;
    for (int64_t d = 0; d < mb.num_documents; ++d)
        rows += std::max<int64_t>(0, mb.cu_seqlens[d + 1] - mb.cu_seqlens[d] - D_);
    return rows;
}

LossSums CudaGlm5Model::losses_from(const double* s, int64_t tv_rows, int64_t real_rows) const {
    const auto& c = cfg_;
    LossSums out;
    out.lm_loss_sum = s[0];
    out.lm_targets = int64_t(s[1]);
    if (D_ > 0) {
        if (c.mtp_loss_type == "e2e_tv") {
            out.mtp_sum = {s[tv_at_]};
            out.mtp_acceptance_sum = s[tv_at_ + 1];
            out.mtp_count = {tv_rows};
        } else {
            for (int64_t k = 0; k < D_; ++k) {
                out.mtp_sum.push_back(s[2 + 2 * k]);
                out.mtp_count.push_back(int64_t(s[3 + 2 * k]));
            }
        }
    }
    out.aux_loss = s[aux_at_] + s[aux_at_ + 1];
    out.mtp_aux_loss = s[aux_at_ + 1];
    for (size_t a = 0; a < idx_sums_.size(); ++a) {
        // Under CP this rank's share of the micro-batch's mean (rows: every rank's real rows);
        // under per-token loss its share of the global batch's.
        const int64_t i = idx_sums_[a] - sums_;
        const double rows = indexer_tokens_ > 0 ? double(indexer_tokens_)
                            : cp_               ? double(real_rows)
                                                : s[i + 1];
        const double loss = rows > 0 ? c.dsa_indexer_loss_coeff * s[i] / rows : 0.0;
        out.indexer_loss += loss;
        out.indexer_layers.emplace_back(idx_layers_[a], loss);
    }
    return out;
}

cuda::HeadLoss CudaGlm5Model::head_loss(const bf16* h, const int32_t* targets, const float* scale,
                                        float dw_beta) const {
    return {.h = h,
            .rows = T_,
            .dim = cfg_.hidden_size,
            .w = (*P_)[head_].w,
            .vocab = cfg_.vocab_size,
            .targets = targets,
            .chunk_rows = chunk_rows_,
            .logits_ws = logits_,
            .dlogits_ws = dlogits_,
            .dlogits_rows = cuda::head_dlogits_rows(T_, chunk_rows_, cfg_.hidden_size),
            .grad_scale = 1.f,
            .grad_scale_dev = scale,
            .dw_beta = dw_beta,
            .dw_type = (*P_)[head_].grad_type(),
            .fp8 = head_fp8_on_ ? &head_fp8_ : nullptr};
}

void CudaGlm5Model::mtp_forward(const ExecContext& ctx, const LossScales& sc,
                                ActivationOffload* off) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    const float idx_gs = sc.backward || sc.indexer_grads ? float(sc.indexer) : 0.f;
    for (int64_t k = 0; k < D_; ++k) {
        MtpActs& A = *mtp_[k];
        const MtpLayer& M = mtp_at(k);
        mtp_concat(ctx, k);
        if (fp8_)
            fp8_->forward(ctx, M.feh, A.cat, A.hin, h, false);
        else
            gemm(ctx, false, true, Tn, h, 2 * h, 1.f, A.cat, 2 * h, (*P_)[M.eh_proj].w, 2 * h, 0.f,
                 A.hin, h);
        if (off) off->before_forward(stage_layers() + k);
        M.layer->forward(ctx, A.layer, A.hin, A.hout, in_, idx_gs);
        if (off) off->after_forward(stage_layers() + k);
    }
    if (c.mtp_loss_type == "e2e_tv") {
        mtp_tv(ctx, sc);
        return;
    }
    for (int64_t k = 0; k < D_; ++k) {
        void* dw = sc.backward && !c.mtp_detach_heads ? (*P_)[head_].grad_out() : nullptr;
        mtp_head_norm(ctx, k, 0, Tn);
        cuda::head_cross_entropy(ctx,
                                 head_loss(mtp_hz_, mtp_[k]->targets, in_.loss_scales + 2 + k,
                                           dw ? P_->grad_beta(head_) : 1.f),
                                 row_loss_, sc.backward ? mtp_[k]->dzk : nullptr, dw);
        cuda::loss_sum(ctx, row_loss_, mtp_[k]->targets, Tn, sums_ + 2 + 2 * k);
    }
}

void CudaGlm5Model::mtp_concat(const ExecContext& ctx, int64_t k) const {
    const int64_t h = cfg_.hidden_size, Tn = T_;
    const float eps = float(cfg_.norm_epsilon);
    const MtpActs& A = *mtp_[k];
    const MtpLayer& M = mtp_at(k);
    cuda::embedding_forward(ctx, A.ids, Tn, (*P_)[embed_].w, h, A.e);  // -1: zero rows
    // The embedding half first.
    cuda::rmsnorm_forward(ctx, A.e, h, (*P_)[M.enorm].w, Tn, h, eps, A.cat, 2 * h, A.rstd_e);
    cuda::rmsnorm_forward(ctx, mtp_prev(k), h, (*P_)[M.hnorm].w, Tn, h, eps, A.cat + h, 2 * h,
                          A.rstd_h);
}

void CudaGlm5Model::mtp_head_norm(const ExecContext& ctx, int64_t k, int64_t r0, int64_t n) const {
    const int64_t h = cfg_.hidden_size;
    const MtpActs& A = *mtp_[k];
    cuda::rmsnorm_forward(ctx, A.hout + r0 * h, h, (*P_)[mtp_at(k).norm].w, n, h,
                          float(cfg_.norm_epsilon), mtp_hz_, h, A.rstd_z + r0);
}

void CudaGlm5Model::mtp_tv(const ExecContext& ctx, const LossScales& sc) {
    // e2e_tv (SPEC §5): p_k[i] = softmax(z_main[i+k]) (no gradient), q_k[i] = softmax(z^k[i]),
    // α_k = Σ_v min(p, q); heads detached: the gradient reaches h^k only.
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, V = c.vocab_size, Tn = T_, D = D_;
    // The row weight is read from the device (in_.loss_scales[2]); 0 without a backward.
    const float row_w = sc.backward ? 1.f : 0.f;
    const bf16* head = (*P_)[head_].w;
    if (cp_) {
        // Every micro-batch row's final hidden from the CP group (exact, as for the keys).
        cp_gather_keys(ctx, in_, h_final_, h, h_final_xfer_, h_final_keys_);
    }
    // Target probabilities of main rows first.. first + rows - 1 into out; rows past the
    // micro-batch stay zero (uniform after the softmax; their chain rows are invalid).
    auto targets = [&](float* out, int64_t first, int64_t rows) {
        const int64_t m = std::max<int64_t>(0, std::min(rows, Tn - first));
        if (m < rows) cuda::zero(ctx, out + m * V, (rows - m) * V * int64_t(sizeof(float)));
        if (m > 0)
            gemm(ctx, false, true, m, V, h, 1.f, h_final_ + first * h, h, head, h, 0.f, out, V, BF,
                 F32);
        cuda::softmax_rows(ctx, out, rows, V);
    };
    for (int64_t r0 = 0; r0 < Tn; r0 += chunk_rows_) {
        const int64_t n = std::min(chunk_rows_, Tn - r0);
        // One block for every depth: block row j is main row r0 + 1 + j.
        if (!tv_per_depth_) targets(tv_p_, r0 + 1, n + D - 1);
        for (int64_t k = 0; k < D; ++k) {
            float* p = tv_target(k);
            float* q = tv_q_ + k * chunk_rows_ * V;
            if (cp_) {
                // Target rows g + k + 1 of the micro-batch (often another CP rank's).
                cuda::gather_key_rows(ctx, h_final_keys_, Tk_, h, in_.key_row + r0, k + 1, n,
                                      tv_rows_);
                gemm(ctx, false, true, n, V, h, 1.f, tv_rows_, h, head, h, 0.f, p, V, BF, F32);
                cuda::softmax_rows(ctx, p, n, V);
            } else if (tv_per_depth_) {
                targets(p, r0 + k + 1, n);
            }
            mtp_head_norm(ctx, k, r0, n);
            gemm(ctx, false, true, n, V, h, 1.f, mtp_hz_, h, head, h, 0.f, q, V, BF, F32);
            cuda::tv_draft_softmax_overlap(ctx, p, q, n, V, tv_alpha_ + k * Tn + r0,
                                           tv_below_ + k * Tn + r0);
        }
        cuda::tv_chain(ctx, tv_alpha_ + r0, tv_valid_ + r0, D, n, Tn, row_w, tv_dalpha_ + r0,
                       sums_ + tv_at_, in_.loss_scales + 2);
        if (!sc.backward) continue;
        for (int64_t k = 0; k < D; ++k) {
            cuda::tv_logit_grad(ctx, tv_target(k), tv_q_ + k * chunk_rows_ * V,
                                tv_dalpha_ + k * Tn + r0, tv_below_ + k * Tn + r0, n, V, dlogits_);
            gemm(ctx, false, false, n, h, V, 1.f, dlogits_, V, head, h, 0.f, mtp_[k]->dzk + r0 * h,
                 h);
        }
    }
}

void CudaGlm5Model::mtp_backward(const ExecContext& ctx, ActivationOffload* off) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_, B2 = sizeof(bf16);
    cuda::zero(ctx, dmtp_h_, Tn * h * B2);
    if (dmtp_kv_)
        cuda::zero(ctx, dmtp_kv_,
                   Tn * (c.kv_lora_rank + c.qk_pos_emb_head_dim) * int64_t(sizeof(float)));
    for (int64_t k = D_ - 1; k >= 0; --k) {
        MtpActs& A = *mtp_[k];
        const MtpLayer& M = mtp_at(k);
        cuda::copy_2d(ctx, dmtp_z_, h * B2, dmtp_h_, h * B2, h * B2, Tn);
        cuda::rmsnorm_backward(ctx, A.dzk, h, A.hout, h, (*P_)[M.norm].w, A.rstd_z, Tn, h, dmtp_z_,
                               h, true, P_->grad_to_add(ctx, M.norm), S_.norm_ws);
        if (off) off->before_backward(stage_layers() + k);
        M.layer->backward(ctx, A.layer, A.hin, dmtp_z_, in_, dmtp_kv_);
        if (off) off->after_backward(stage_layers() + k);
        mtp_concat(ctx, k);
        if (fp8_) {
            fp8_->dgrad(ctx, M.feh, dmtp_z_, dmtp_cat_, false);
            fp8_->wgrad(ctx, M.feh, dmtp_z_, A.cat);
        } else {
            gemm(ctx, false, false, Tn, 2 * h, h, 1.f, dmtp_z_, h, (*P_)[M.eh_proj].w, 2 * h, 0.f,
                 dmtp_cat_, 2 * h);
            gemm(ctx, true, false, h, 2 * h, Tn, 1.f, dmtp_z_, h, A.cat, 2 * h,
                 P_->grad_beta(M.eh_proj), (*P_)[M.eh_proj].grad_out(), 2 * h, BF,
                 (*P_)[M.eh_proj].grad_type());
        }
        cuda::rmsnorm_backward(ctx, dmtp_cat_, 2 * h, A.e, h, (*P_)[M.enorm].w, A.rstd_e, Tn, h,
                               dmtp_e_, h, false, P_->grad_to_add(ctx, M.enorm), S_.norm_ws);
        if (!c.mtp_detach_heads)
            cuda::embedding_backward(ctx, A.ids, Tn, dmtp_e_, h, P_->grad_to_add(ctx, embed_));
        cuda::rmsnorm_backward(ctx, dmtp_cat_ + h, 2 * h, mtp_prev(k), h, (*P_)[M.hnorm].w,
                               A.rstd_h, Tn, h, dmtp_h_, h, false, P_->grad_to_add(ctx, M.hnorm),
                               S_.norm_ws);
    }
    if (!c.mtp_detach_heads) cuda::add_inplace(ctx, dh_, dmtp_h_, Tn * h);
}

void CudaGlm5Model::reset_moe_stats(const ExecContext& ctx) const {
    for (CudaMoeLayer* m : moes()) m->reset_stats(ctx);
    if (stash_) stash_->reset(ctx, /*new_step=*/true);
}

std::vector<std::vector<int64_t>> CudaGlm5Model::moe_loads(const ExecContext& ctx) const {
    std::vector<std::vector<int64_t>> out;
    for (const auto& l : layers_)
        if (l->moe()) {
            std::vector<int64_t> v(l->moe()->experts());
            cuda::download(ctx, v.data(), l->moe()->load(), int64_t(v.size() * sizeof(int64_t)));
            out.push_back(v);
        }
    return out;
}

std::vector<size_t> CudaGlm5Model::moe_layers_per_stage() const {
    std::vector<size_t> out(stages_.size(), 0);
    for (size_t l = 0; l < layers_.size(); ++l)
        out[size_t(chunk_of_[l])] += layers_[l]->moe() ? 1 : 0;
    return out;
}

int64_t CudaGlm5Model::moe_dropped(const ExecContext& ctx) const {
    int64_t total = 0;
    for (CudaMoeLayer* m : moes()) {
        int64_t d = 0;
        cuda::download(ctx, &d, m->dropped(), sizeof(int64_t));
        total += d;
    }
    return total;
}

std::vector<std::pair<int64_t*, int64_t>> CudaGlm5Model::moe_stat_buffers() const {
    std::vector<std::pair<int64_t*, int64_t>> out;
    for (CudaMoeLayer* m : moes()) {
        out.emplace_back(m->load(), m->experts());
        out.emplace_back(m->dropped(), 1);
    }
    return out;
}

void CudaGlm5Model::update_router_bias(const ExecContext& ctx, double rate) const {
    for (CudaMoeLayer* m : moes()) m->update_bias(ctx, rate);
}

}  // namespace sparsetron::cuda
