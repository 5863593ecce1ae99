#include "sparsetron/ops/attention/attention_plan.h"

#include <algorithm>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/attention/masked_layout.h"
#include "sparsetron/ops/attention/sparse_mqa_tc_shape.h"

namespace sparsetron::cuda {

using F = SparseAttentionForm;

bool flash_shape(int64_t heads, int64_t dqk, int64_t dv) {
    return heads == kFlashHeads && dqk == kFlashQkDim && dv == kFlashVDim;
}

bool gathered_shape(int64_t heads, int64_t dqk, int64_t dv) {
    using namespace tc_shape;
    return heads % kHeadsPerBlock == 0 && dqk % 16 == 0 && dv % 16 == 0 && dqk <= kMaxQkDim &&
           dv <= dqk && backward_smem(dqk, dv) <= kSmemLimit && forward_smem(dqk, dv) <= kSmemLimit;
}

const char* form_name(SparseAttentionForm form) {
    switch (form) {
        case F::ExpandedMasked:
            return "ExpandedMasked";
        case F::AbsorbedMasked:
            return "AbsorbedMasked";
        case F::AbsorbedFlashMasked:
            return "AbsorbedFlashMasked";
        case F::AbsorbedFlash:
            return "AbsorbedFlash";
        case F::AbsorbedGathered:
            return "AbsorbedGathered";
        case F::AbsorbedReference:
            return "AbsorbedReference";
    }
    return "?";
}

std::vector<SparseAttentionForm> all_sparse_attention_forms() {
    return {F::ExpandedMasked, F::AbsorbedMasked,   F::AbsorbedFlashMasked,
            F::AbsorbedFlash,  F::AbsorbedGathered, F::AbsorbedReference};
}

bool SparseAttentionPlan::masked_forward() const {
    return form == F::ExpandedMasked || form == F::AbsorbedMasked;
}
bool SparseAttentionPlan::masked_backward() const {
    return masked_forward() || form == F::AbsorbedFlashMasked;
}

std::string SparseAttentionPlan::describe() const {
    std::string s = form_name(form);
    if (workspace_bytes > 0) s += cat(", workspace ", workspace_bytes, " bytes");
    if (saved_probs_elems > 0) s += cat(", ", saved_probs_elems, " probabilities kept");
    return s + cat(", query blocks of ", query_block_rows, " rows");
}

int64_t sparse_mqa_masked_workspace_bytes(int64_t tokens, int64_t heads, int64_t key_rows) {
    const int64_t keys = key_rows > 0 ? key_rows : tokens;
    if (tokens == 0 || !masked::fits(keys)) return 0;
    const int64_t row = heads * masked::leading_dim(keys);  // elements per query token
    const int64_t cq = std::max<int64_t>(1, std::min(tokens, masked::kChunkElems / row));
    return cq * row * masked::kBytesPerElem;
}

int64_t sparse_mqa_saved_probs_elems(int64_t tokens, int64_t heads, int64_t workspace_bytes) {
    if (tokens == 0 || workspace_bytes == 0) return 0;
    // The forward's chunks of the rows this workspace holds, each [rows, ld(t1)].
    const int64_t cq = std::min(tokens, masked::chunk_rows(tokens, heads, workspace_bytes));
    ST_CHECK(cq >= 1, "sparse MQA (masked): a workspace of ", workspace_bytes,
             " bytes holds no chunk");
    int64_t elems = 0;
    for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
        const int64_t t1 = std::min(tokens, t0 + cq);
        elems += (t1 - t0) * heads * masked::leading_dim(t1);
    }
    return elems;
}

namespace {

int64_t keys_of(const SparseAttentionProblem& p) {
    return p.key_rows > 0 ? p.key_rows : p.tokens;
}
bool context_parallel(const SparseAttentionProblem& p) {
    return p.key_rows > 0;
}
bool flash_runs(const SparseAttentionProblem& p) {
    return p.sm90a && flash_shape(p.heads, p.dqk, p.dv);
}
// The masked forms' workspace: one chunk of every query row against the widest key range.
bool masked_runs(const SparseAttentionProblem& p) {
    return p.tokens > 0 && masked::fits(keys_of(p));
}
// The expanded form keeps neither the latent keys that MTP's kv sharing hands on nor the absorbed
// Q' / K' that a dense-loss teacher recomputes from; under context parallelism only the absorbed
// form attends over the gathered key rows.
bool expanded_allowed(const SparseAttentionProblem& p) {
    return p.teacher != IndexerTeacher::Dense && !p.shared_keys && !context_parallel(p);
}

// The plan of `form` (supported by `p`): its workspace, kept probabilities and query blocks.
SparseAttentionPlan plan_of(const SparseAttentionProblem& p, SparseAttentionForm form) {
    SparseAttentionPlan plan;
    plan.form = form;
    plan.query_block_rows = p.tokens;
    if (plan.masked_backward())
        plan.workspace_bytes = sparse_mqa_masked_workspace_bytes(p.tokens, p.heads, p.key_rows);
    // Keep the forward's probabilities when a layer's fit the bound: the backward then skips one
    // score GEMM and one probability kernel per chunk (not under CP, whose chunks score all key
    // rows; not after the flash forward, which computes no P).
    if (plan.masked_forward() && !context_parallel(p)) {
        const int64_t elems = sparse_mqa_saved_probs_elems(p.tokens, p.heads, plan.workspace_bytes);
        if (elems * 2 <= p.saved_probs_max) plan.saved_probs_elems = elems;
    }
    // The recomputed gathered core in query blocks: each block runs its up-projection and core
    // and adds its keys' gradient into one dK'; exact where nothing reads the whole Q' and LSE
    // after the core (no indexer-loss teacher), without CP and in bf16.
    if (!plan.masked_backward() && p.recompute_up && p.recompute_core &&
        p.teacher == IndexerTeacher::None && !context_parallel(p) && !p.fp8 && p.block_rows > 0)
        plan.query_block_rows = std::min(p.tokens, p.block_rows);
    return plan;
}

}  // namespace

std::vector<SparseAttentionForm> supported_forms(const SparseAttentionProblem& p) {
    std::vector<SparseAttentionForm> out;
    if (masked_runs(p) && expanded_allowed(p)) out.push_back(F::ExpandedMasked);
    if (masked_runs(p)) out.push_back(F::AbsorbedMasked);
    if (masked_runs(p) && flash_runs(p)) out.push_back(F::AbsorbedFlashMasked);
    if (flash_runs(p)) out.push_back(F::AbsorbedFlash);
    if (gathered_shape(p.heads, p.dqk, p.dv)) out.push_back(F::AbsorbedGathered);
    out.push_back(F::AbsorbedReference);
    return out;
}

SparseAttentionPlan plan_sparse_attention(const SparseAttentionProblem& p) {
    // Dense work per query row ~ keys / 2 against <= top-k gathered ones, at 0.47x the FLOPs per
    // pair in the expanded form: the masked GEMMs win while the keys are at most twice the top-k;
    // past that the flash kernels over the selected keys do (docs/cuda.md).
    const bool masked = masked_runs(p) && keys_of(p) <= 2 * p.topk;
    if (masked) {
        if (expanded_allowed(p)) return plan_of(p, F::ExpandedMasked);
        // The flash forward, unless the masked forward keeps P for the backward.
        const SparseAttentionPlan keep = plan_of(p, F::AbsorbedMasked);
        if (keep.saved_probs_elems > 0 || !flash_runs(p)) return keep;
        return plan_of(p, F::AbsorbedFlashMasked);
    }
    if (flash_runs(p)) return plan_of(p, F::AbsorbedFlash);
    if (gathered_shape(p.heads, p.dqk, p.dv)) return plan_of(p, F::AbsorbedGathered);
    return plan_of(p, F::AbsorbedReference);
}

SparseAttentionPlan plan_sparse_attention(const SparseAttentionProblem& p,
                                          SparseAttentionForm form) {
    const std::vector<SparseAttentionForm> ok = supported_forms(p);
    ST_CHECK(std::find(ok.begin(), ok.end(), form) != ok.end(), "sparse attention: the ",
             form_name(form), " form does not run ", p.tokens, " rows x ", p.heads, " heads, qk ",
             p.dqk, ", v ", p.dv, " here");
    return plan_of(p, form);
}

}  // namespace sparsetron::cuda
