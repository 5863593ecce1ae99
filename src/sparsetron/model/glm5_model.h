// The GLM-5 model on the CPU backend (SPEC §1-5): embedding, decoder layers (MLA with optional DSA,
// dense SwiGLU or MoE), final RMSNorm, the output head fused with cross-entropy over row chunks,
// and the repeated MTP layer with its cross-entropy or end-to-end TV loss.
//
// Explicit forward and backward (DESIGN §1.3): every buffer is declared into the memory plan at
// construction; forward saves activations per use site (the MTP layer keeps one set per depth);
// backward consumes them. Templated on the element type so the whole model can be
// gradient-checked in fp64.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/pipeline_stage.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/data/packer.h"
#include "sparsetron/model/buffers.h"
#include "sparsetron/model/decoder_layer.h"
#include "sparsetron/model/losses.h"
#include "sparsetron/model/param_store.h"

namespace sparsetron {

template <typename T>
class Glm5Model {
  private:
    struct MtpSlots {
        MemoryPlan::Slot ids, e, en, rstd_e, hn, rstd_h, cat, hin, hout, hz, rstd_z;
        typename DecoderLayer<T>::Slots layer;
    };
    struct MtpActs {
        int32_t* ids;
        T *e, *en, *rstd_e, *hn, *rstd_h, *cat, *hin, *hout, *hz, *rstd_z;
        typename DecoderLayer<T>::Acts layer;
    };

  public:
    // key_tokens > 0: context parallelism. The model computes `tokens` rows (this CP rank's
    // share, parallel/context/cp_shard.h: cp_local_tokens) of micro-batches of key_tokens slots;
    // its attention and indexer read keys of every row (set_context_parallel gives the CP group).
    // `stage`: pipeline parallelism, the part of the model this rank holds (its parameters and
    // buffers only); the last stage also holds the embedding when the MTP layer reads it (a copy
    // marked pipeline_copy, its gradient summed with the first stage's).
    // The model binds `params`, the parameter table of `stage` (model/param_table.h) planned in
    // `plan`; its activations and workspace are planned there too.
    Glm5Model(const ModelConfig& cfg, const ParamStore& params, MemoryPlan& plan, int64_t tokens,
              int64_t max_docs, int64_t chunk_rows, int64_t key_tokens = 0,
              const PipelineStage& stage = {});
    // The same with a table of its own, built from `cfg` (tests and tools that need one model).
    Glm5Model(const ModelConfig& cfg, MemoryPlan& plan, int64_t tokens, int64_t max_docs,
              int64_t chunk_rows, int64_t key_tokens = 0, const PipelineStage& stage = {});
    ~Glm5Model();
    void bind();

    const ParamStore& params() const { return *store_; }
    const ModelConfig& config() const { return cfg_; }
    int64_t tokens() const { return T_; }

    // A micro-batch of key_tokens slots under CP (this rank takes its chunks of every document),
    // of `tokens` slots otherwise.
    void load_inputs(const MicroBatch& mb);
    LossSums forward_backward(const LossScales& scales);
    // The two halves, for a pipeline schedule: forward returns the micro-batch's losses (the
    // head's gradient is computed with it when scales.backward); backward follows the forward
    // of the same micro-batch (its activations restored when other forwards ran in between).
    LossSums forward(const LossScales& scales);
    void backward(const LossScales& scales);
    // Forward only, LM loss only (eval) — or with backward at a uniform per-target scale.
    LossSums forward_backward(double lm_scale, bool backward);

    // MoE bookkeeping across a step.
    void reset_moe_stats();
    std::vector<std::vector<int64_t>> moe_loads() const;
    int64_t moe_dropped() const;
    // Every MoE layer's routing statistics flattened (loads, then dropped counts), and back:
    // data-parallel ranks sum them before the bias update and the metrics.
    std::vector<int64_t> moe_stats_flat() const;
    void set_moe_stats_flat(const std::vector<int64_t>& flat);
    // Expert parallelism: every MoE layer exchanges its rows over `ep` (the layout's EP group,
    // of the size the model was planned for: cfg.expert_parallel_ranks).
    void set_expert_parallel(Comm* ep);
    // Context parallelism over `cp` (the layout's CP group; the model must be planned with
    // key_tokens). Loss sums are then this rank's rows' shares: they add up over the group.
    void set_context_parallel(Comm* cp);
    // fp8_recipe: blockwise (float models): the linears the CUDA model runs in FP8 (every
    // layer's MLA projections but kv_b, dense and shared MLPs, the routed experts' forward and
    // input-gradient GEMMs, the MTP eh_proj) through the same quantizers (model/fp8_gemms.h).
    void set_fp8_blockwise(bool on);
    void update_router_bias(double rate);

    // Logits of token slot `row` after a forward: final-norm output @ lm_head^T, [vocab].
    void logits_row(int64_t row, T* out) const;

    // The activations of decoder-layer application `a`: backbone layer a < num_layers, MTP depth
    // a - num_layers + 1 after them (tests read the top-k there); the inputs of the loaded rows.
    const typename DecoderLayer<T>::Acts& application(int64_t a) const {
        return a < cfg_.num_layers ? layer_acts_.at(a - L0_)
                                   : mtp_acts_.at(a - cfg_.num_layers).layer;
    }
    const StepInputs& inputs() const { return in_; }
    // MTP depth k (1-based) of the loaded rows: each row's input token (k ahead in its document)
    // and target (k + 1 ahead), -1 where the document ends first.
    const int32_t* mtp_ids(int64_t k) const { return mtp_acts_.at(size_t(k - 1)).ids; }
    const int32_t* mtp_targets(int64_t k) const { return mtp_targets_.at(size_t(k - 1)); }

    T* param(int64_t i) const { return param_ptr_[i]; }
    T* grad(int64_t i) const { return grad_ptr_[i]; }

    // Pipeline parallelism. The stage's input rows (received before a forward; the embedding's
    // output on the first stage), its output rows (sent after it), and the residual gradient
    // (received before a backward: d output; after it: d input, sent back).
    const PipelineStage& stage() const { return stage_; }
    T* stage_input() const { return x_.front(); }
    const T* stage_output() const { return x_.back(); }
    T* stage_grad() const { return dx_; }
    // The activations of one micro-batch (the Activations arena and what the layers keep on the
    // host), saved after its forward and restored before its backward while other micro-batches'
    // forwards run in between (1F1B keeps up to one per later stage).
    struct ActivationSnapshot {
        std::vector<char> bytes;
        std::vector<typename DecoderLayer<T>::Acts> layers;
        std::vector<MtpActs> mtp;
        StepInputs in;
    };
    size_t activation_bytes() const { return plan_.class_bytes(MemClass::Activations); }
    void save_activations(ActivationSnapshot& into) const;
    void restore_activations(const ActivationSnapshot& from);

    // Models of this element type constructed in the process (a CUDA run builds none).
    static int64_t constructed() { return constructed_; }

  private:
    Glm5Model(const ModelConfig& cfg, std::unique_ptr<ParamStore> owned, MemoryPlan& plan,
              int64_t tokens, int64_t max_docs, int64_t chunk_rows, int64_t key_tokens,
              const PipelineStage& stage);
    void mtp_forward(const LossScales& sc, LossSums& out);
    void mtp_backward(const LossScales& sc);
    void mtp_tv_loss(const LossScales& sc, LossSums& out);
    bool kv_share() const { return D_ > 0 && cfg_.uses_dsa() && cfg_.dsa_mtp_index_kv_share; }

    ModelConfig cfg_;
    MemoryPlan& plan_;
    PipelineStage stage_;
    int64_t L0_ = 0, L1_ = 0;  // this stage's decoder layers [L0_, L1_)
    Buffers buf_;
    const ParamStore* store_ = nullptr;
    std::unique_ptr<ParamStore> owned_store_;  // the table this model built, if it built one
    static std::atomic<int64_t> constructed_;
    int64_t T_, max_docs_, chunk_rows_, D_ = 0;
    bool cp_ = false;  // planned for context parallelism
    int64_t Tk_;       // micro-batch rows (T_ without CP)
    std::vector<std::unique_ptr<DecoderLayer<T>>> layers_;
    std::vector<typename DecoderLayer<T>::Slots> layer_slots_;
    std::vector<typename DecoderLayer<T>::Acts> layer_acts_;
    std::vector<MemoryPlan::Slot> s_x_;  // residual stream: x_0 .. x_L
    std::vector<T*> x_;
    int64_t embed_ = -1, final_norm_ = -1, head_ = -1;  // -1: another stage holds it
    // Pipeline: the top-k received with the rows (not on the first stage, nor without DSA).
    std::vector<T*> param_ptr_, grad_ptr_;

    // MTP: one layer applied at every depth (mtp_use_repeated_layer), or one per depth.
    struct MtpLayer {
        int64_t enorm, hnorm, eh_proj, norm;  // parameter indices
        std::unique_ptr<DecoderLayer<T>> layer;
    };
    std::vector<MtpLayer> mtp_layers_;
    bool fp8_ = false;                         // set_fp8_blockwise: the MTP eh_proj's GEMMs
    const MtpLayer& mtp_at(int64_t k) const {  // the layer of depth k + 1
        return mtp_layers_[cfg_.mtp_use_repeated_layer ? 0 : size_t(k)];
    }
    std::vector<MtpSlots> mtp_slots_;
    std::vector<MtpActs> mtp_acts_;
    std::vector<MemoryPlan::Slot> s_mtp_targets_;
    std::vector<int32_t*> mtp_targets_;
    MemoryPlan::Slot s_dmtp_kv_ = -1;  // dK' accumulated by kv-sharing depths
    T* dmtp_kv_ = nullptr;
    MemoryPlan::Slot s_dmtp_h_, s_dmtp_cat_, s_dmtp_z_, s_dmtp_e_, s_tv_p_, s_tv_q_, s_tv_alpha_;
    T *dmtp_h_ = nullptr, *dmtp_cat_ = nullptr, *dmtp_z_ = nullptr, *dmtp_e_ = nullptr;
    T *tv_p_ = nullptr, *tv_q_ = nullptr, *tv_alpha_ = nullptr;
    std::vector<MemoryPlan::Slot> s_dmtp_zk_;
    std::vector<T*> dmtp_zk_;

    // Inputs.
    MemoryPlan::Slot s_tokens_, s_targets_, s_positions_, s_cu_, s_key_row_ = -1, s_key_cu_ = -1;
    StepInputs in_;
    int32_t* targets_ = nullptr;
    MemoryPlan::Slot s_h_final_, s_rstd_final_;
    T *h_final_ = nullptr, *rstd_final_ = nullptr;
    // e2e_tv under CP: every micro-batch row's final hidden (the TV targets read rows i + k + 1)
    // and a chunk of them gathered for one GEMM.
    MemoryPlan::Slot s_h_final_keys_ = -1, s_tv_rows_ = -1;
    T *h_final_keys_ = nullptr, *tv_rows_ = nullptr;
    MemoryPlan::Slot s_dx_, s_dh_, s_logits_;
    T *dx_ = nullptr, *dh_ = nullptr, *logits_ = nullptr;
};

extern template class Glm5Model<float>;
extern template class Glm5Model<double>;

}  // namespace sparsetron
