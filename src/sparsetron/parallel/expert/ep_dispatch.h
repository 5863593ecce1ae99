// Expert-parallel token exchange (SPEC §10 EP) over an EP group of W ranks: expert e lives on rank
// e / (E / W). dispatch() sends each routed (token, choice) row to its expert's rank, combine()
// brings the expert outputs back and adds them with the gates, in choice order (deterministic).
// The CPU form: counts are exchanged first and buffers sized exactly; the GPU form keeps counts on
// the device with worst-case receive buffers (tokens x top-k per source rank).
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

struct EpDispatchPlan {
    int ranks = 1;
    int64_t experts_per_rank = 0;
    std::vector<int64_t> send_rows, recv_rows;  // per rank
    // Local (token * k + choice) slot of each sent row: destination-major, then expert, then slot.
    std::vector<int32_t> send_slot;
    // Global expert of each received row (source-rank order, each source's rows by expert).
    std::vector<int32_t> recv_expert;
    int64_t total_recv() const;
};

// Collective over `ep`: topk [tokens, k] global expert ids (-1: dropped, not sent).
EpDispatchPlan plan_ep_dispatch(Comm& ep, const int32_t* topk, int64_t tokens, int64_t k,
                                int64_t experts);
// x [tokens, dim] -> recv [total_recv, dim] (collective).
void ep_dispatch(Comm& ep, const EpDispatchPlan& plan, const float* x, int64_t k, int64_t dim,
                 float* recv);
// y[t] += Σ_j gates[t, j] * out of slot (t, j), outputs [total_recv, dim] in received order
// (collective).
void ep_combine(Comm& ep, const EpDispatchPlan& plan, const float* expert_out, const float* gates,
                int64_t tokens, int64_t k, int64_t dim, float* y);

}  // namespace sparsetron
