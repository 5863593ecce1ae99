// How a layer's DSA indexer runs on CUDA, decided once (as attention_plan.h for the attention):
// the forms of its scores and of the loss's backward through them, the problem (rows, key rows
// under context parallelism, heads, dims, the query block, whether the loss runs, the device) and
// the one function from it to the plan (forms, query blocks, workspace). The model plans each
// indexer once; indexer_scores and indexer_scores_backward switch on the plan's forms. Host code
// only: it builds and is tested without CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsetron::cuda {

enum class IndexerScoresForm : uint8_t {
    Wgmma,  // the fused wgmma kernel (indexer_wgmma.cu): sm_90a, 16 / 32 / 64 heads of 64 / 128
    Gemm,   // cuBLASLt dot products in chunks, then ReLU and head weights: the whole micro-batch
            // without CP (query row t is key row t), with the planned workspace
    Rows,   // one simple kernel: any shape
};
enum class IndexerBackwardForm : uint8_t {
    Gemm,  // GEMMs over chunks of query rows, deterministic: a workspace, no CP
    Rows,  // a kernel per query row with atomics
};
const char* form_name(IndexerScoresForm form);
const char* form_name(IndexerBackwardForm form);
bool indexer_wgmma_shape(int64_t heads, int64_t dim);

struct IndexerProblem {
    int64_t tokens = 0;    // query rows this rank computes
    int64_t key_rows = 0;  // the micro-batch's key rows under context parallelism (0: none)
    int64_t heads = 0, dim = 0;
    int64_t query_block = 0;  // dsa_indexer_query_block (0: the whole micro-batch)
    bool loss = false;        // the indexer loss runs (its backward through the scores)
    bool sm90a = false;
};

struct IndexerPlan {
    IndexerScoresForm scores = IndexerScoresForm::Rows;
    IndexerBackwardForm backward = IndexerBackwardForm::Rows;
    int64_t query_block_rows = 0;  // rows scored at once (tokens: one block)
    int64_t workspace_bytes = 0;   // the GEMM forms' dot products
    std::string describe() const;
};

// Blocks of query_block rows where a rank's rows are more (scores [block, keys], each block's
// top-k kept; the loss scores each block again); the workspace of the whole micro-batch's GEMM
// scores, or in blocks of the loss backward's chunks of kIndexerLossChunkRows rows (none under
// CP); the wgmma scores where the device and shape allow, the GEMM form where its workspace is
// planned, the simple kernel otherwise; the GEMM backward where a chunk fits the workspace.
IndexerPlan plan_indexer(const IndexerProblem& p);
// The scores' forms a problem can run (the simple kernel always), in the enum's order.
std::vector<IndexerScoresForm> supported_score_forms(const IndexerProblem& p);

// Rows per chunk of the loss backward's GEMM form in query blocks.
constexpr int64_t kIndexerLossChunkRows = 64;
// The GEMM scores' workspace for `tokens` rows (chunks of 128 MiB of fp32 dot products at most),
// and the GEMM backward's bytes per query row against `keys` keys.
int64_t indexer_scores_workspace_bytes(int64_t tokens, int64_t heads);
int64_t indexer_scores_backward_bytes_per_token(int64_t keys, int64_t heads);

}  // namespace sparsetron::cuda
