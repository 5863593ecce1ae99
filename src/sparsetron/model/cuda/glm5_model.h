// The GLM-5 model on CUDA (the CPU Glm5Model, model/glm5_model.h, on the device): same
// parameters (by HF name, cloned from a ParamStore), same losses and gradients, bf16 activations.
// One micro-batch at a time: load_inputs() uploads it (with its loss scales: the kernels read
// them from the device), forward_backward() runs it on the session's stream and reads the loss
// sums back (the only host synchronization of a micro-batch). A captured step instead copies
// each micro-batch's staged input block in with copy_inputs_from() (a device copy).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sparsetron/config/pipeline_stage.h"
#include "sparsetron/cuda/chunk_graphs.h"
#include "sparsetron/data/packer.h"
#include "sparsetron/model/cuda/decoder_layer.h"
#include "sparsetron/model/losses.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/ops/loss/loss.h"

namespace sparsetron::cuda {

// Where the distributed optimizer keeps each parameter's fp32 master (optim/owner_assignment.h),
// as the model plans it: `owner` per parameter of the host store (empty, or -1: every rank keeps
// it; kSplitRows: each of the `ranks` ranks an equal range of its rows), this `rank`, and
// `fp8_gather` (fp8_param_gather: an FP8 linear's owner broadcasts its FP8 copy, so only the
// owner keeps its master).
struct MasterPlacement {
    static constexpr int kSplitRows = -2;  // owner_assignment.h's kRowSplit
    std::vector<int> owner;
    int rank = 0, ranks = 1;
    bool fp8_gather = false;
    // Optimizer offload: this fraction of the bytes of the masters this rank updates in pinned
    // host memory (the masters other ranks also keep, broadcast over NCCL, stay on the device).
    double host_fraction = 0;
    // bf16 gradient buffers (grad_reduce_in_bf16) for the weights GEMMs write
    // (bf16_gradient_allowed); the rest keep fp32 gradients.
    bool bf16_gradients = false;
    bool sharded(int64_t i) const { return !owner.empty() && owner[size_t(i)] >= 0; }
    bool split(int64_t i) const { return !owner.empty() && owner[size_t(i)] == kSplitRows; }
    bool here(int64_t i) const { return !sharded(i) || owner[size_t(i)] == rank; }
};

class CudaGlm5Model {
  public:
    // `host_store` gives the parameter table (names, shapes, groups); the device plan gets a copy.
    // key_tokens > 0: context parallelism (the CPU Glm5Model's rule): `tokens` rows of this
    // rank of micro-batches of key_tokens slots; set_context_parallel() gives the CP group.
    // fp8_blockwise: the dense linears (MLA projections but kv_b, dense MLPs, shared experts,
    // eh_proj) as FP8 blockwise linears (model/cuda/fp8_linear.h).
    // `stages`: pipeline parallelism, the stages this rank holds in the order it runs them (one,
    // or its chunks under interleaving; empty: the whole model). `host_store` holds their
    // parameters (make_param_table's rule).
    // `masters`: the distributed optimizer's placement; a master kept on another rank is not
    // planned here unless a kernel reads it (CudaParams::read_master).
    CudaGlm5Model(const ModelConfig& cfg, const ParamStore& host_store, MemoryPlan& plan,
                  int64_t tokens, int64_t max_docs, int64_t chunk_rows, int64_t key_tokens = 0,
                  bool fp8_blockwise = false, const std::vector<PipelineStage>& stages = {},
                  const MasterPlacement& masters = {});
    ~CudaGlm5Model();
    // After plan.allocate(Device::CUDA).
    void bind(const ExecContext& ctx);

    const ParamStore& params() const { return *store_; }
    const ModelConfig& config() const { return cfg_; }
    const CudaParams& cuda_params() const { return *P_; }
    void refresh_bf16(const ExecContext& ctx) const { P_->refresh_bf16(ctx); }

    void load_inputs(const ExecContext& ctx, const MicroBatch& mb, const LossScales& scales);
    // The input block: every per-micro-batch input and its loss scales, input_words() int32
    // words. stage_inputs() packs a micro-batch and uploads it to `dst` (the model's own block or
    // a staging slot of that size); copy_inputs_from() copies a staged block in on the stream.
    int64_t input_words() const { return input_words_; }
    void stage_inputs(const ExecContext& ctx, const MicroBatch& mb, const LossScales& scales,
                      int32_t* dst);
    void copy_inputs_from(const ExecContext& ctx, const int32_t* src);
    // The same from the staged block at slot *index (a device index: one captured copy serves
    // every slot).
    void copy_inputs_from_slot(const ExecContext& ctx, const int32_t* slots, const int32_t* index);
    // The loss sums on the device (n_sums() doubles) and their reading from a host copy;
    // tv_rows(): the e2e TV rows of a micro-batch (for LossSums::mtp_count).
    const double* sums() const { return sums_; }
    int64_t n_sums() const { return n_sums_; }
    LossSums losses_from(const double* sums, const MicroBatch& mb) const;
    // enqueue(): the micro-batch's forward (and backward) on the stream, nothing else: no host
    // synchronization, allocation or host read, so it can be captured in a CUDA graph.
    // read_losses(): downloads the loss sums of the last enqueue (synchronizes).
    void enqueue(const ExecContext& ctx, const LossScales& scales);
    // The two halves, for a pipeline schedule: the forward of chunk `chunk` (on the last stage
    // with the head's and MTP's losses, whose gradients it computes when scales.backward), and
    // the backward of the chunk's micro-batch whose forward ran last (the loss sums are zeroed by
    // each forward: a chunk's are its layers' share). `recompute`: the forward of a micro-batch
    // again, for its backward after other micro-batches' forwards (the losses, the indexer loss's
    // gradient and the routing statistics were taken the first time and are left alone).
    // `kept`: this forward's backward follows it; false: a stage's forward whose activations the
    // schedule discards (run again before its backward), so the MoE stash keeps no pages of it
    // and activation offload moves nothing.
    void enqueue_forward(const ExecContext& ctx, const LossScales& scales, bool recompute = false,
                         bool kept = true, int chunk = 0);
    void enqueue_backward(const ExecContext& ctx, const LossScales& scales, int chunk = 0);
    LossSums read_losses(const ExecContext& ctx) const;
    LossSums forward_backward(const ExecContext& ctx, const LossScales& scales) {
        enqueue(ctx, scales);
        return read_losses(ctx);
    }

    void reset_moe_stats(const ExecContext& ctx) const;
    // Per backbone MoE layer of this rank, in the order of its stages.
    std::vector<std::vector<int64_t>> moe_loads(const ExecContext& ctx) const;
    // How many backbone MoE layers each stage of the rank holds.
    std::vector<size_t> moe_layers_per_stage() const;
    int64_t moe_dropped(const ExecContext& ctx) const;
    void update_router_bias(const ExecContext& ctx, double rate) const;
    // Every MoE application's routing statistics on the device (load per expert, dropped rows):
    // what data parallelism sums over ranks before the router bias update.
    std::vector<std::pair<int64_t*, int64_t>> moe_stat_buffers() const;

    // Where in a micro-batch's backward each parameter's gradient is complete, for reducing it
    // while the rest of the backward runs: point 0 after the MTP backward (the MTP layer, and
    // lm_head, whose gradient the main head adds in the forward), 1 after the final norm, 2 + i
    // after backbone layer L-1-i, 2 + L after the embedding (and anything else). enqueue() calls
    // the hook (when set) at each point, in order, with the stream at that point.
    // With several chunks the points run over all of their layers (the last chunk's first).
    int backward_points() const { return int(stage_layers()) + 3; }
    int backward_point(const std::string& param_name) const;
    void set_backward_hook(std::function<void(int)> hook) { hook_ = std::move(hook); }
    // The MoE paged stash (moe_paged_stash), or null: its use in the step since the last
    // reset_moe_stats(), and the device flag a push sets on overflow.
    const MoeStash* moe_stash() const { return stash_.get(); }
    // The eager redo of a step that overflowed the stash or the expert-parallel receive budget:
    // the stash bypassed (MoeStash::set_bypass), the routed experts in token chunks under a
    // budget (CudaMoeLayer::set_redo).
    void set_moe_redo(bool on);
    // Chunk-wise graphs (cuda_graph_impl: local; null: eager): each layer's forward and
    // backward, the head and MTP, as chunks of `graphs` (cuda/chunk_graphs.h), but in a redo.
    // Their work is replayed at any place in a step: the gradients must be in accumulate-only
    // mode (CudaParams::begin_gradients).
    void set_chunk_graphs(cuda::ChunkGraphs* graphs) { chunks_ = graphs; }

    // Pipeline parallelism (config/pipeline_stage.h). A chunk's input rows (written before its
    // forward on every stage but the first), its output rows (sent on after it) and the residual
    // gradient (written before a backward on every stage but the last: d output; after it:
    // d input, sent back). No top-k travels: every stage starts on a layer that computes its own
    // (check_index_share_pipeline_split). Each chunk's layers keep their own activations.
    const std::vector<PipelineStage>& stages() const { return stages_; }
    int64_t stage_layers() const { return int64_t(layers_.size()); }
    int64_t tokens() const { return T_; }
    bf16* stage_input(int chunk = 0) const { return x_[size_t(x_at(chunk_begin_[size_t(chunk)]))]; }
    const bf16* stage_output(int chunk = 0) const {
        return x_[size_t(x_at(chunk_begin_[size_t(chunk) + 1] - 1) + 1)];
    }
    bf16* stage_grad() const { return dx_; }
    // The embedding's parameter index (-1 where the stage holds none).
    int64_t embedding_param() const { return embed_; }

    // Expert parallelism (cfg.expert_parallel_ranks > 1): every MoE layer exchanges rows
    // through `ep` (set once, before the first step).
    void set_expert_exchange(cuda::ExpertExchange* ep);
    // Context parallelism over `cp` (device collectives; the model planned with key_tokens).
    // Loss sums are then this rank's rows' shares.
    void set_context_parallel(Comm* cp);

  private:
    struct MtpActs {
        int32_t *ids, *targets;
        // e, cat: the embedding rows and the eh_proj input [enorm(e), hnorm(prev)] (the norms
        // write its halves), one buffer each that every depth shares: the backward makes both
        // again from the token ids, the previous depth's output and the kept rstd.
        bf16 *e, *cat, *hin, *hout, *dzk;
        float *rstd_e, *rstd_h, *rstd_z;
        CudaDecoderLayer::Acts layer;
    };
    bool kv_share() const { return D_ > 0 && cfg_.uses_dsa() && cfg_.dsa_mtp_index_kv_share; }
    void mtp_forward(const ExecContext& ctx, const LossScales& sc, ActivationOffload* off);
    // What depth k's hnorm reads: the previous depth's layer output, the final hidden for k = 0.
    const bf16* mtp_prev(int64_t k) const { return k > 0 ? mtp_[k - 1]->hout : h_final_; }
    // Depth k's eh_proj input into A.cat (its rstd too): the forward's kernels on the same rows.
    void mtp_concat(const ExecContext& ctx, int64_t k) const;
    // Depth k's head-norm output of rows [r0, r0 + n) into mtp_hz_ (and their rstd).
    void mtp_head_norm(const ExecContext& ctx, int64_t k, int64_t r0, int64_t n) const;
    void mtp_tv(const ExecContext& ctx, const LossScales& sc);
    // The output head with cross-entropy on rows h [T, hidden] against `targets`, its gradient
    // scaled by the device scalar `scale` and its weight gradient written with `dw_beta`.
    cuda::HeadLoss head_loss(const bf16* h, const int32_t* targets, const float* scale,
                             float dw_beta) const;
    // e2e_tv's target-probability rows: one shared block without CP, a block per depth under it.
    int64_t tv_target_rows() const {
        return tv_per_depth_ ? D_ * chunk_rows_ : chunk_rows_ + D_ - 1;
    }
    float* tv_target(int64_t k) const {
        return tv_p_ + (tv_per_depth_ ? k * chunk_rows_ : k) * cfg_.vocab_size;
    }
    void mtp_backward(const ExecContext& ctx, ActivationOffload* off);
    int64_t tv_rows(const MicroBatch& mb) const;
    LossSums losses_from(const double* sums, int64_t tv_rows, int64_t real_rows) const;
    std::vector<CudaMoeLayer*> moes() const;

    ModelConfig cfg_;
    MemoryPlan& plan_;
    std::vector<PipelineStage> stages_;
    bool first_ = true, last_ = true;  // holds the first stage (embedding) / the last (head)
    // Local layer i (layers_[i]) is decoder layer layer_id_[i] of chunk chunk_of_[i]; chunk c
    // holds local layers [chunk_begin_[c], chunk_begin_[c + 1]). x_ holds each chunk's layer
    // inputs and its output: local layer i reads x_[x_at(i)] and writes x_[x_at(i) + 1].
    std::vector<int64_t> layer_id_, chunk_begin_;
    std::vector<int> chunk_of_;
    int64_t x_at(int64_t i) const { return i + chunk_of_[size_t(i)]; }
    int64_t local_layer(int64_t layer) const;  // -1: not this rank's
    std::unique_ptr<ParamStore> store_;
    std::unique_ptr<CudaParams> P_;
    CudaBuffers B_;
    CudaShared S_;
    std::unique_ptr<MoeStash> stash_;
    std::unique_ptr<ActivationOffload> offload_;  // fine_grained_activation_offloading
    std::unique_ptr<Fp8Weights> fp8_;
    // fp8_output_proj: the head's FP8 W and W^T (quantized from its master every forward) and
    // the operands' scratch; `head_fp8_on_` false: the head's GEMMs in bf16.
    Fp8Copy head8_;
    HeadFp8 head_fp8_;
    bool head_fp8_on_ = false;
    int64_t T_, max_docs_, chunk_rows_, D_ = 0;
    // Input words of the documents' rows and aux-loss weights (CudaInputs::docs).
    int64_t doc_words() const { return 3 * max_docs_ + 1; }
    bool cp_ = false;                                    // planned for context parallelism
    int64_t Tk_;                                         // micro-batch rows (T_ without CP)
    bf16 *h_final_keys_ = nullptr, *tv_rows_ = nullptr;  // CP + e2e_tv: every row's final hidden
    float* h_final_xfer_ = nullptr;    // CP + e2e_tv: the key exchange's buffer (cp_keys.h)
    int32_t* all_key_rows_ = nullptr;  // CP: CudaInputs::all_key_rows
    std::vector<std::unique_ptr<CudaDecoderLayer>> layers_;
    std::vector<std::unique_ptr<CudaDecoderLayer::Acts>> acts_;
    std::vector<bf16*> x_;
    int64_t embed_ = -1, final_norm_ = -1, head_ = -1;  // -1: another stage holds it
    // MTP: one layer applied at every depth (mtp_use_repeated_layer), or one per depth.
    struct MtpLayer {
        int64_t enorm, hnorm, eh_proj, norm;  // parameter indices
        int feh = -1;                         // eh_proj's FP8 handle
        std::unique_ptr<CudaDecoderLayer> layer;
    };
    std::vector<MtpLayer> mtp_layers_;
    const MtpLayer& mtp_at(int64_t k) const {  // the layer of depth k + 1
        return mtp_layers_[cfg_.mtp_use_repeated_layer ? 0 : size_t(k)];
    }
    std::vector<std::unique_ptr<MtpActs>> mtp_;
    CudaInputs in_;
    bf16 *h_final_, *dx_, *dh_, *dlogits_, *dmtp_h_, *dmtp_cat_, *dmtp_z_, *dmtp_e_;
    // The MTP head-norm output of the rows the loss is at: every row of one depth (cross
    // entropy), one chunk of rows (e2e_tv); its gradient is kept per depth (dzk).
    bf16* mtp_hz_ = nullptr;
    float *rstd_final_, *logits_, *row_loss_, *dmtp_kv_ = nullptr;
    float *tv_p_ = nullptr, *tv_q_ = nullptr, *tv_alpha_ = nullptr, *tv_dalpha_ = nullptr;
    float* tv_below_ = nullptr;
    bool tv_per_depth_ = false;  // a target block per depth (under CP)
    uint8_t* tv_valid_ = nullptr;
    // Loss sums on the device: [lm Σ, lm n, (mtp Σ_k, mtp n_k) per depth, tv Σ, accept Σ,
    // (Σ KL, rows) per indexer application].
    double* sums_ = nullptr;
    // Slots of sums_: LM and per-depth MTP [2 each], TV chain [2], MoE aux loss [2: the
    // backbone's layers, the MTP layer's applications], then each indexer application's [2].
    int64_t n_sums_ = 0, tv_at_ = 0, aux_at_ = 0, idx_at_ = 0;
    std::vector<double*> idx_sums_;    // one [2] per indexer application, in forward order
    std::vector<int64_t> idx_layers_;  // each one's layer (MTP depth k: num_layers + k - 1)
    void pack_inputs(const MicroBatch& mb, const LossScales& sc, std::vector<int32_t>& out) const;
    void carve_inputs();
    int32_t* in_block_ = nullptr;  // see pack_inputs() for the layout
    int64_t input_words_ = 0, n_scales_ = 0, last_tv_rows_ = 0, last_real_rows_ = 0;
    int64_t indexer_tokens_ = 0;    // LossScales::indexer_tokens of the micro-batches staged
    std::vector<int32_t> h_block_;  // host staging of one micro-batch's block
    std::function<void(int)> hook_;
    cuda::ChunkGraphs* chunks_ = nullptr;
    bool redo_ = false;  // set_moe_redo
    // `enqueue` as the chunk `key` (with the CP group) of the chunk-wise graphs, or eagerly.
    void graph_chunk(const std::string& key, const std::function<void()>& enqueue) const;
};

}  // namespace sparsetron::cuda
