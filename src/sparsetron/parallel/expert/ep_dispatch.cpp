#include "sparsetron/parallel/expert/ep_dispatch.h"

#include <algorithm>
#include <numeric>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

std::vector<int64_t> bytes_of(const std::vector<int64_t>& rows, int64_t row_bytes) {
    std::vector<int64_t> b(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) b[i] = rows[i] * row_bytes;
    return b;
}

}  // namespace

int64_t EpDispatchPlan::total_recv() const {
    return std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t(0));
}

EpDispatchPlan plan_ep_dispatch(Comm& ep, const int32_t* topk, int64_t tokens, int64_t k,
                                int64_t experts) {
    EpDispatchPlan p;
    p.ranks = ep.size();
    ST_CHECK(experts % p.ranks == 0, "expert parallelism: ", experts, " experts over ", p.ranks,
             " ranks (expert_model_parallel_size must divide num_moe_experts)");
    p.experts_per_rank = experts / p.ranks;
    // Slots sorted by (destination, expert, slot): stable sort of the slots by expert.
    std::vector<int32_t> slots;
    for (int64_t s = 0; s < tokens * k; ++s)
        if (topk[s] >= 0) {
            ST_CHECK(topk[s] < experts, "expert id ", topk[s], " of ", experts);
            slots.push_back(int32_t(s));
        }
    std::stable_sort(slots.begin(), slots.end(),
                     [&](int32_t a, int32_t b) { return topk[a] < topk[b]; });
    p.send_slot = slots;
    p.send_rows.assign(size_t(p.ranks), 0);
    for (int32_t s : slots) ++p.send_rows[size_t(topk[s] / p.experts_per_rank)];
    // Counts first, then the experts of the rows each rank will receive.
    p.recv_rows.assign(size_t(p.ranks), 0);
    ep.alltoallv(p.send_rows.data(), std::vector<int64_t>(size_t(p.ranks), 8), p.recv_rows.data(),
                 std::vector<int64_t>(size_t(p.ranks), 8));
    std::vector<int32_t> send_expert(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) send_expert[i] = topk[slots[i]];
    p.recv_expert.assign(size_t(p.total_recv()), -1);
    ep.alltoallv(send_expert.data(), bytes_of(p.send_rows, 4), p.recv_expert.data(),
                 bytes_of(p.recv_rows, 4));
    return p;
}

void ep_dispatch(Comm& ep, const EpDispatchPlan& p, const float* x, int64_t k, int64_t dim,
                 float* recv) {
    std::vector<float> send(p.send_slot.size() * size_t(dim));
    for (size_t i = 0; i < p.send_slot.size(); ++i) {
        const float* row = x + int64_t(p.send_slot[i] / k) * dim;
        std::copy_n(row, dim, send.data() + i * size_t(dim));
    }
    const int64_t row_bytes = dim * int64_t(sizeof(float));
    ep.alltoallv(send.data(), bytes_of(p.send_rows, row_bytes), recv,
                 bytes_of(p.recv_rows, row_bytes));
}

void ep_combine(Comm& ep, const EpDispatchPlan& p, const float* expert_out, const float* gates,
                int64_t tokens, int64_t k, int64_t dim, float* y) {
    // The reverse exchange: what a rank received goes back to its source, in the same order.
    std::vector<float> back(p.send_slot.size() * size_t(dim));
    const int64_t row_bytes = dim * int64_t(sizeof(float));
    ep.alltoallv(expert_out, bytes_of(p.recv_rows, row_bytes), back.data(),
                 bytes_of(p.send_rows, row_bytes));
    std::vector<int64_t> row_of(size_t(tokens * k), -1);
    for (size_t i = 0; i < p.send_slot.size(); ++i) row_of[size_t(p.send_slot[i])] = int64_t(i);
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t j = 0; j < k; ++j) {
            const int64_t r = row_of[size_t(t * k + j)];
            if (r < 0) continue;
            const float g = gates[t * k + j];
            const float* o = back.data() + r * dim;
            for (int64_t c = 0; c < dim; ++c) y[t * dim + c] += g * o[c];
        }
}

}  // namespace sparsetron
