// Expert-parallel token exchange on the GPUs of one node (SPEC §10 EP): the rows a rank routed
// to experts it does not own go to the owners and the owners' results come back, by kernels that
// read peer GPU memory over NVLink (CUDA IPC), with the counts read on the device: nothing waits
// on the host, so a captured CUDA graph holds the whole exchange. Receive buffers are sized for
// the worst case (every rank sending every row to one owner).
//
// Layouts (W ranks, E experts, El = E / W per rank, rank q owns experts [q El, (q + 1) El)):
// - source layout: a rank's permuted rows, expert-major by global expert (offsets[E + 1]);
// - owner layout: rank q's received rows, by local expert j, then by source rank p.
// Each exchange: begin_send() waits until every peer finished reading this rank's previous
// publication and hands out the shared region, where the caller's kernels write the rows to send
// (no extra copy); the exchange call publishes them (a flag with the exchange's epoch), pulls from
// every peer's region once its flag shows the epoch, and says so. A peer that does
// not publish within a minute makes the kernel trap (the process fails, the launcher takes the
// job down): no silent hang.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/parallel/comm.h"

namespace sparsetron::cuda {

class ExpertExchange {
  public:
    // Collective over `ep` (all its ranks on this node, one GPU each): maps every rank's shared
    // region of `max_rows` rows of `dim` bf16 values (dim a multiple of 8) plus the offsets.
    ExpertExchange(Comm& ep, int64_t experts, int64_t max_rows, int64_t dim);
    ~ExpertExchange();
    ExpertExchange(const ExpertExchange&) = delete;
    ExpertExchange& operator=(const ExpertExchange&) = delete;

    int rank() const { return rank_; }
    int size() const { return size_; }
    int64_t local_experts() const { return experts_ / size_; }
    // Device memory of this rank's shared region (the worst-case receive side of every peer):
    // a separate allocation (CUDA IPC maps whole allocations), counted with the plan.
    int64_t region_bytes() const { return region_bytes_; }
    static int64_t region_bytes_for(int64_t experts, int64_t max_rows, int64_t dim);

    // Enqueues the wait for every peer to finish reading this rank's previous publication and
    // returns where the next exchange's rows go ([max_rows, dim] bf16 in the shared region);
    // write them with kernels on the same stream, then call one of the three exchanges.
    bf16* begin_send(const ExecContext& ctx);
    // The sent rows are in this rank's source layout (offsets [E + 1] on the device) -> the
    // owners. Writes all_offsets [W, E + 1] (every rank's offsets: the application's later
    // exchanges use them), recv_offsets [El + 1] (the owner layout per local expert) and y
    // (owner layout).
    void dispatch(const ExecContext& ctx, const int32_t* offsets, int32_t* all_offsets,
                  int32_t* recv_offsets, bf16* y);
    // The same direction with an earlier dispatch's layouts (output gradients in the backward).
    void dispatch_again(const ExecContext& ctx, const int32_t* all_offsets, bf16* y);
    // The sent rows are in the owner layout -> back to every source's layout (x).
    void combine(const ExecContext& ctx, const int32_t* all_offsets, bf16* x);

  private:
    void publish(const ExecContext& ctx, const int32_t* offsets);
    template <bool Dispatch>
    void pull(const ExecContext& ctx, const int32_t* all_offsets, bf16* out);
    void finish(const ExecContext& ctx);
    int rank_ = 0, size_ = 1;
    int64_t experts_ = 0, dim_ = 0, region_bytes_ = 0;
    void* region_ = nullptr;     // this rank's shared region (cudaMalloc)
    void** peers_ = nullptr;     // device [W]: every rank's region, mapped here (self included)
    std::vector<void*> opened_;  // peers' regions opened through IPC
    uint32_t* epoch_ = nullptr;  // device: exchanges so far
};

}  // namespace sparsetron::cuda
