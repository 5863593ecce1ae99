// `sparsetron bench-exchange`: the expert-parallel exchange (parallel/expert_exchange.h) in both
// transports checked and timed against a plain NCCL all-to-all of the same bytes, on the GPUs of
// a launched job.
#pragma once

#include <cstdint>
#include <string>

#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

struct ExchangeBenchOptions {
    int64_t rows = 32768;  // routed rows per rank (tokens x top-k)
    int64_t dim = 6144;    // hidden size (bf16 values per row)
    int64_t experts = 16;  // uniform routing: rows / experts rows per expert
    int iters = 20, warmup = 3;
};

struct ExchangeBenchResult {
    int ranks = 0;
    int64_t rows = 0, dim = 0, experts = 0;
    double peer_bytes = 0;  // bytes each rank sends to other ranks per exchange
    // Medians of a dispatch: the NVLink exchange (0 when the ranks span hosts), the NCCL
    // exchange, and a bare NCCL all-to-all of the blocks uniform routing sends.
    double exchange_ms = 0, nccl_exchange_ms = 0, nccl_ms = 0;
    double exchange_gbps = 0, nccl_exchange_gbps = 0, nccl_gbps = 0;
    std::string gpu;
    std::string to_json() const;
};

// Collective over `comm` (NCCL, one GPU per rank): for each transport (NVLink where every rank
// shares a host, NCCL), a dispatch then a combine of known rows, compared bit for bit with what
// they must deliver (throws on a mismatch), then `iters` timed dispatches; then `iters` timed
// ncclSend/ncclRecv all-to-alls moving the same blocks.
ExchangeBenchResult bench_expert_exchange(Comm& comm, const ExchangeBenchOptions& o);

}  // namespace sparsetron
