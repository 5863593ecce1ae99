// The DSA lightning indexer on CUDA (the CPU DsaIndexer, model/dsa_indexer.h): scores, top-k,
// the KL loss against the attention and its gradient into the indexer's own weights.
#pragma once

#include "sparsetron/config/model_config.h"
#include "sparsetron/model/cuda/cuda_common.h"
#include "sparsetron/ops/indexer/indexer_plan.h"

namespace sparsetron::cuda {

class CudaDsaIndexer {
  public:
    struct Acts {
        // Workspace shared by every indexer (the forward's loss is their last reader).
        bf16 *q, *k_raw, *k;
        float *mean, *rstd, *w;
        int32_t *topk, *len;    // top-k: micro-batch key rows (kept per layer)
        bf16* kkeys = nullptr;  // CP: every micro-batch row's k_I, gathered over the CP group
    };
    struct Teacher {
        const bf16* q;  // Q' [T, H, L]
        const bf16* k;  // K' [key rows, L]
        const float* lse;
        int64_t heads, dim;
        float scale;
        const float* prob_sum = nullptr;  // Σ_h P from the attention (sparse loss), or null
    };
    CudaDsaIndexer(const ModelConfig& cfg, const CudaParams& P, CudaBuffers& B, CudaShared& S,
                   const std::string& hf_prefix, int64_t tokens, int64_t key_tokens = 0);
    void declare(Acts& A, CudaBuffers& B, const std::string& p) const;
    int64_t kslots() const { return K_; }

    void forward(const ExecContext& ctx, const Acts& A, const bf16* a, const bf16* cq,
                 const CudaInputs& in) const;
    // Adds Σ KL and the row count into sums[0..1] (device); with grad_scale != 0 also
    // accumulates d(coeff * mean KL)/d(indexer weights) times the micro-batch's scale, which the
    // kernels read from in.loss_scales[1] (grad_scale only says whether there is a backward).
    void loss(const ExecContext& ctx, const Acts& A, const bf16* a, const bf16* cq,
              const CudaInputs& in, const Teacher& t, float grad_scale, double* sums) const;

  private:
    const ModelConfig& c_;
    const CudaParams& P_;
    CudaShared& S_;
    int64_t T_, h_, HI_, dI_, dr_, qr_, K_;
    bool cp_;                    // planned for context parallelism
    int64_t Tk_;                 // key rows
    float* keys_f32_ = nullptr;  // CP: [Tk, dI] dk_I of every key row
    float* cp_xfer_ = nullptr;   // CP: the key exchange's buffer (cp_keys.h)
    float wscale_;
    int64_t wq_, wk_, knw_, knb_, ww_;
    IndexerPlan plan_;  // the scores' and the loss backward's forms, blocks and workspace
    // Query rows scored at once: all rows, or (no CP, long micro-batches) blocks of
    // dsa_indexer_query_block rows, so the fp32 scores (and the loss's gradient) are
    // [block, key rows], not [rows, rows].
    int64_t block_;
    // The scores of query rows [t0, t0 + n) against keys 0 .. t0 + n - 1 into scores_ (rows that
    // long): the block form, the forward's and the loss's alike.
    void score_block(const ExecContext& ctx, const Acts& A, const CudaInputs& in, int64_t t0,
                     int64_t n) const;
    // The loss and its gradient over query rows [t0, t0 + n), whose scores are in scores_.
    void block_loss(const ExecContext& ctx, const Acts& A, const CudaInputs& in, const Teacher& t,
                    int64_t t0, int64_t n, bool backward) const;
    float *scores_, *dscore_ = nullptr, *kl_, *dw32_, *dk32_;
    float* dots_;  // indexer_scores' GEMM workspace
    int64_t dots_bytes_;
    bf16 *dq_, *dk_, *dkraw_, *dwb_;
};

}  // namespace sparsetron::cuda
