// One decoder layer on CUDA (the CPU DecoderLayer, model/decoder_layer.h).
#pragma once

#include <memory>

#include "sparsetron/model/cuda/dsa_indexer.h"
#include "sparsetron/model/cuda/mla_attention.h"
#include "sparsetron/model/cuda/mlp.h"
#include "sparsetron/model/cuda/moe.h"

namespace sparsetron::cuda {

class CudaDecoderLayer {
  public:
    struct Acts {
        bf16 *a, *x_mid, *m;
        float *rstd_in, *rstd_post;
        CudaMlaAttention::Acts attn;
        CudaDsaIndexer::Acts idx;
        CudaSwiGluMlp::Acts mlp;
        CudaMoeLayer::Acts moe;
        const int32_t* topk = nullptr;  // the top-k this application attends over
        const int32_t* topk_len = nullptr;
        bool skip_indexer = false;       // a kv-sharing MTP depth: depth 1 ran the indexer
        double* indexer_sums = nullptr;  // device [2]: Σ KL and rows of this application
    };
    CudaDecoderLayer(const ModelConfig& cfg, const CudaParams& P, CudaBuffers& B, CudaShared& S,
                     int64_t layer0, int64_t tokens, int64_t key_tokens = 0);
    void declare(Acts& A, CudaBuffers& B, const std::string& p) const;
    bool has_indexer() const { return indexer_ != nullptr; }
    CudaMoeLayer* moe() const { return moe_.get(); }

    void forward(const ExecContext& ctx, Acts& A, const bf16* x, bf16* out, const CudaInputs& in,
                 float indexer_grad_scale) const;
    // dx: in dL/d out, out dL/d x.
    void backward(const ExecContext& ctx, const Acts& A, const bf16* x, bf16* dx,
                  const CudaInputs& in, float* kv_grad_accum) const;

  private:
    const ModelConfig& c_;
    const CudaParams& P_;
    CudaShared& S_;
    int64_t layer_, T_, h_, kslots_ = 0;
    ActivationPolicy act_;
    bool recompute_norms_;  // selective recompute of layernorm
    int64_t in_norm_, post_norm_;
    std::unique_ptr<CudaMlaAttention> attn_;
    std::unique_ptr<CudaDsaIndexer> indexer_;
    std::unique_ptr<CudaSwiGluMlp> mlp_;
    std::unique_ptr<CudaMoeLayer> moe_;
    bf16 *da_, *dm_;
    float* prob_sum_ = nullptr;  // the attention's Σ_h P for the sparse indexer loss
};

}  // namespace sparsetron::cuda
