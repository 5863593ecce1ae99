// One decoder layer on CUDA (the CPU DecoderLayer, model/decoder_layer.h).
#pragma once

#include <memory>

#include "sparsetron/model/gpu/dsa_indexer.h"
#include "sparsetron/model/gpu/mla_attention.h"
#include "sparsetron/model/gpu/mlp.h"
#include "sparsetron/model/gpu/moe.h"

namespace sparsetron::gpu {

class GpuDecoderLayer {
  public:
    struct Acts {
        bf16 *a, *x_mid, *m;
        float *rstd_in, *rstd_post;
        GpuMlaAttention::Acts attn;
        GpuDsaIndexer::Acts idx;
        GpuSwiGluMlp::Acts mlp;
        GpuMoeLayer::Acts moe;
        const int32_t* topk = nullptr;  // the top-k this application attends over
        const int32_t* topk_len = nullptr;
        bool skip_indexer = false;       // a kv-sharing MTP depth: depth 1 ran the indexer
        double* indexer_sums = nullptr;  // device [2]: Σ KL and rows of this application
    };
    GpuDecoderLayer(const ModelConfig& cfg, const GpuParams& P, GpuBuffers& B, GpuShared& S,
                    int64_t layer0, int64_t tokens, int64_t key_tokens = 0);
    void declare(Acts& A, GpuBuffers& B, const std::string& p) const;
    bool has_indexer() const { return indexer_ != nullptr; }
    GpuMoeLayer* moe() const { return moe_.get(); }

    void forward(const ExecContext& ctx, Acts& A, const bf16* x, bf16* out, const GpuInputs& in,
                 float indexer_grad_scale) const;
    // dx: in dL/d out, out dL/d x.
    void backward(const ExecContext& ctx, const Acts& A, const bf16* x, bf16* dx,
                  const GpuInputs& in, float* kv_grad_accum) const;

  private:
    const ModelConfig& c_;
    const GpuParams& P_;
    GpuShared& S_;
    int64_t layer_, T_, h_, kslots_ = 0;
    bool recompute_norms_;  // selective recompute of layernorm
    int64_t in_norm_, post_norm_;
    std::unique_ptr<GpuMlaAttention> attn_;
    std::unique_ptr<GpuDsaIndexer> indexer_;
    std::unique_ptr<GpuSwiGluMlp> mlp_;
    std::unique_ptr<GpuMoeLayer> moe_;
    bf16 *da_, *dm_;
    float* prob_sum_ = nullptr;  // the attention's Σ_h P for the sparse indexer loss
};

}  // namespace sparsetron::gpu
