// Expert-parallel token exchange (SPEC §10 EP): the rows a rank routed to experts it does not own
// go to the owners and the owners' results come back, with the per-expert counts read on the
// device: nothing waits on the host, so a captured CUDA graph holds the whole exchange. Two
// transports implement it (exchange_transport.h chooses one per run):
// - CUDA IPC over NVLink (ipc_expert_exchange.h): every peer's memory mapped, rows pulled by
//   kernels; needs the expert-parallel group on one node;
// - NCCL (nccl_expert_exchange.h): fixed-size blocks per peer through a grouped send/recv, sized
//   by the plan's bound on what one source sends one owner; works across nodes.
//
// Layouts (W ranks, E experts, El = E / W per rank, rank q owns experts [q El, (q + 1) El)):
// - source layout: a rank's permuted rows, expert-major by global expert (offsets[E + 1]);
// - owner layout: rank q's received rows, by local expert j, then by source rank p.
// Each exchange: begin_send() hands out where the caller's kernels write the rows to send (no
// extra copy on the MoE layer's side), then one of dispatch / dispatch_again / combine moves
// them.
#pragma once

#include <cstdint>
#include <memory>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/parallel/expert/exchange_transport.h"

namespace sparsetron::cuda {

// What an exchange carries: rows of `dim` bf16 values (a multiple of 8), at most `max_rows` rows
// published by a rank in one exchange (its routed rows, or the results its experts computed)
// and at most `pair_rows` from one source to one owner (ModelConfig::moe_ep_received_rows / W:
// the dropless bound, or the receive budget's share; rows over it are dropped and flagged).
struct ExchangeShape {
    int64_t experts = 0, max_rows = 0, pair_rows = 0, dim = 0;
};

class ExpertExchange {
  public:
    virtual ~ExpertExchange();
    ExpertExchange(const ExpertExchange&) = delete;
    ExpertExchange& operator=(const ExpertExchange&) = delete;

    int rank() const { return rank_; }
    int size() const { return size_; }
    int64_t local_experts() const { return shape_.experts / size_; }
    virtual ExchangeTransport transport() const = 0;
    // Device memory the exchange allocated (its buffers, outside the memory plan).
    virtual int64_t device_bytes() const = 0;

    // Returns where the next exchange's rows go ([max_rows, dim] bf16); write them with kernels
    // on the same stream, then call one of the three exchanges.
    virtual bf16* begin_send(const ExecContext& ctx) = 0;
    // The sent rows are in this rank's source layout (offsets [E + 1] on the device) -> the
    // owners. Writes all_offsets [W, E + 1] (every rank's offsets: the application's later
    // exchanges use them), recv_offsets [El + 1] (the owner layout per local expert) and y
    // (owner layout).
    virtual void dispatch(const ExecContext& ctx, const int32_t* offsets, int32_t* all_offsets,
                          int32_t* recv_offsets, bf16* y) = 0;
    // The same direction with an earlier dispatch's layouts (output gradients in the backward).
    virtual void dispatch_again(const ExecContext& ctx, const int32_t* all_offsets, bf16* y) = 0;
    // The sent rows are in the owner layout -> back to every source's layout (x).
    virtual void combine(const ExecContext& ctx, const int32_t* all_offsets, bf16* x) = 0;

    // Device int32, set by a dispatch where a source had more rows for this rank than
    // `pair_rows` (a receive budget below the dropless bound): only the first pair_rows of them
    // moved, the rest were dropped, and the step must be redone (the engine's veto and redo).
    // Cleared by clear_over_budget (stream-ordered; capturable).
    int32_t* over_budget() const { return over_budget_; }
    void clear_over_budget(const ExecContext& ctx) const;

  protected:
    ExpertExchange(const Comm& ep, const ExchangeShape& shape);
    int rank_ = 0, size_ = 1;
    ExchangeShape shape_;
    int32_t* over_budget_ = nullptr;
};

// Collective over `ep`: the exchange of that transport (its buffers allocated, peers mapped).
std::unique_ptr<ExpertExchange> make_expert_exchange(ExchangeTransport t, Comm& ep,
                                                     const ExchangeShape& shape);
// The device bytes make_expert_exchange would allocate on a group of `ranks` ranks.
int64_t expert_exchange_bytes(ExchangeTransport t, const ExchangeShape& shape, int ranks);

}  // namespace sparsetron::cuda
