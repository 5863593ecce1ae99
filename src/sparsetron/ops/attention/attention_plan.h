// How a layer's sparse attention runs on CUDA, decided once (DeepGEMM's heuristics file, ggml's
// supports_op): the forms, the problem a layer poses (shape, device, recompute, context
// parallelism, what else reads the attention, the memory bound on kept probabilities) and the one
// function from a problem to its plan (the form, its workspace, the probabilities the forward
// keeps, the query blocks). The model plans each layer once and keeps the plan; the kernels'
// dispatch (sparse_mqa_forward / _backward) switches on it; the tests walk supported_forms();
// docs/cuda.md's "Which kernel runs when" table is checked against plan_sparse_attention. Host code
// only: it builds and is tested without CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsetron::cuda {

// The GLM-5 shape the flash wgmma kernels take (heads, latent + rope, latent).
constexpr int64_t kFlashHeads = 64, kFlashQkDim = 576, kFlashVDim = 512;
bool flash_shape(int64_t heads, int64_t dqk, int64_t dv);
// The shapes the tensor-core gathered kernels take (groups of 32 heads, dims of 16, shared memory).
bool gathered_shape(int64_t heads, int64_t dqk, int64_t dv);

enum class SparseAttentionForm : uint8_t {
    // MLA's expanded per-head form: scores over qk + v dims per head, as masked dense GEMMs batched
    // over the heads (sparse_mha_*_masked).
    ExpandedMasked,
    // The absorbed form (MQA over the shared latent): masked dense GEMMs forward and backward.
    AbsorbedMasked,
    // ... the flash wgmma forward, the masked dense backward (P recomputed from the forward's lse).
    AbsorbedFlashMasked,
    // ... the flash wgmma forward and backward over the gathered selected keys.
    AbsorbedFlash,
    // ... the tensor-core kernels over the gathered selected keys.
    AbsorbedGathered,
    // ... one block per (row, head): any shape.
    AbsorbedReference,
};
const char* form_name(SparseAttentionForm form);  // the enumerator's name
std::vector<SparseAttentionForm> all_sparse_attention_forms();

// What the indexer loss of the layer reads from its attention (its teacher).
enum class IndexerTeacher : uint8_t {
    None,
    Sparse,  // Σ_h P per selected key, from the forward's probability kernels
    Dense,   // the absorbed Q' and K', recomputed over every key
};

struct SparseAttentionProblem {
    int64_t tokens = 0;    // query rows this rank computes
    int64_t key_rows = 0;  // latent key rows under context parallelism (0: none, keys = tokens)
    int64_t heads = 0, dqk = 0, dv = 0;  // the absorbed form's: latent + rope dims, latent dims
    int64_t topk = 0;                    // selected keys per row (at most the key rows)
    bool sm90a = false;                  // the device runs the wgmma kernels
    IndexerTeacher teacher = IndexerTeacher::None;
    bool shared_keys = false;  // MTP's kv sharing hands this layer's latent keys on (or reads them)
    bool recompute_up = false, recompute_core = false;  // selective recompute of mla_up_proj, core
    bool fp8 = false;                                   // FP8 linears on the attention's path
    int64_t block_rows = 0;       // recompute_block_rows: query rows per block when recomputed
    int64_t saved_probs_max = 0;  // bytes the forward may keep of P per layer
};

struct SparseAttentionPlan {
    SparseAttentionForm form = SparseAttentionForm::AbsorbedReference;
    int64_t workspace_bytes = 0;    // the masked forms' S / dP / P chunks (0 for the others)
    int64_t saved_probs_elems = 0;  // bf16 P the masked forward keeps for the backward (0: none)
    int64_t query_block_rows = 0;   // query rows per block of the recomputed core (tokens: one)
    bool absorbed() const { return form != SparseAttentionForm::ExpandedMasked; }
    bool masked_forward() const;
    bool masked_backward() const;
    std::string describe() const;
};

// The forms the problem's shape and device can run (the reference always), in the enum's order.
std::vector<SparseAttentionForm> supported_forms(const SparseAttentionProblem& p);
// The form that runs: the masked forms while the keys are at most twice the top-k (where the
// dense GEMMs' causal half of the keys outgrows the selected ones the gathered forms win), the
// expanded one of those where nothing needs the latent keys or Q' (0.47x the FLOPs at the GLM-5
// shape), the flash kernels on sm_90a at the GLM-5 shape, the tensor-core ones where their shape
// fits, the reference otherwise; with its workspace, kept probabilities and query blocks.
SparseAttentionPlan plan_sparse_attention(const SparseAttentionProblem& p);
// The plan of a given supported form (tests, benchmarks); throws for an unsupported one.
SparseAttentionPlan plan_sparse_attention(const SparseAttentionProblem& p,
                                          SparseAttentionForm form);

// The masked form's workspace for one chunk holding every query row (0 where a key row exceeds
// its shared-memory bound), and the bf16 elements of every chunk's P kept by a masked forward
// with `workspace_bytes` (chunks of the rows that workspace holds).
int64_t sparse_mqa_masked_workspace_bytes(int64_t tokens, int64_t heads, int64_t key_rows = 0);
int64_t sparse_mqa_saved_probs_elems(int64_t tokens, int64_t heads, int64_t workspace_bytes);

}  // namespace sparsetron::cuda
