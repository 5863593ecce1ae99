#include "sparsetron/ops/indexer/indexer_plan.h"

#include <algorithm>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/indexer/indexer_layout.h"

namespace sparsetron::cuda {

const char* form_name(IndexerScoresForm form) {
    switch (form) {
        case IndexerScoresForm::Wgmma:
            return "Wgmma";
        case IndexerScoresForm::Gemm:
            return "Gemm";
        case IndexerScoresForm::Rows:
            return "Rows";
    }
    return "?";
}

const char* form_name(IndexerBackwardForm form) {
    return form == IndexerBackwardForm::Gemm ? "Gemm" : "Rows";
}

bool indexer_wgmma_shape(int64_t heads, int64_t dim) {
    return (heads == 16 || heads == 32 || heads == 64) && (dim == 64 || dim == 128);
}

std::string IndexerPlan::describe() const {
    return cat("scores ", form_name(scores), ", backward ", form_name(backward),
               ", query blocks of ", query_block_rows, " rows, workspace ", workspace_bytes,
               " bytes");
}

int64_t indexer_scores_workspace_bytes(int64_t tokens, int64_t heads) {
    using namespace indexer_layout;
    return dots_chunk_tokens(tokens, heads, kDotsChunkElems) * heads * dots_ld(tokens) *
           int64_t(sizeof(float));
}

int64_t indexer_scores_backward_bytes_per_token(int64_t keys, int64_t heads) {
    return heads * indexer_layout::dlogits_ld(keys) * int64_t(sizeof(float) + 2);
}

IndexerPlan plan_indexer(const IndexerProblem& p) {
    IndexerPlan plan;
    const bool cp = p.key_rows > 0;
    plan.query_block_rows = p.query_block > 0 ? std::min(p.tokens, p.query_block) : p.tokens;
    const bool whole = plan.query_block_rows == p.tokens;
    // The GEMM forms pair query row t with key row t: not under CP. In blocks only the loss
    // backward takes one, in chunks of kIndexerLossChunkRows rows.
    plan.workspace_bytes = cp       ? 0
                           : whole  ? indexer_scores_workspace_bytes(p.tokens, p.heads)
                           : p.loss ? kIndexerLossChunkRows *
                                          indexer_scores_backward_bytes_per_token(p.tokens, p.heads)
                                    : 0;
    if (p.sm90a && indexer_wgmma_shape(p.heads, p.dim))
        plan.scores = IndexerScoresForm::Wgmma;
    else if (whole && plan.workspace_bytes > 0)
        plan.scores = IndexerScoresForm::Gemm;
    plan.backward =
        !cp && plan.workspace_bytes >= indexer_scores_backward_bytes_per_token(p.tokens, p.heads)
            ? IndexerBackwardForm::Gemm
            : IndexerBackwardForm::Rows;
    return plan;
}

std::vector<IndexerScoresForm> supported_score_forms(const IndexerProblem& p) {
    std::vector<IndexerScoresForm> out;
    if (p.sm90a && indexer_wgmma_shape(p.heads, p.dim)) out.push_back(IndexerScoresForm::Wgmma);
    if (p.key_rows == 0) out.push_back(IndexerScoresForm::Gemm);
    out.push_back(IndexerScoresForm::Rows);
    return out;
}

}  // namespace sparsetron::cuda
