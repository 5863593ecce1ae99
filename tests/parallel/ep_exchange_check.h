// Shared by test_parallel (one process) and test_mpi (2 and 4 ranks): the EP exchange of random
// routing against the same computation done locally. Expert e is f_e(x) = (e + 1) x + e.
#pragma once

#include <gtest/gtest.h>

#include "sparsetron/core/rng.h"
#include "sparsetron/parallel/expert/ep_dispatch.h"

namespace sparsetron::test {

inline void check_ep_exchange(Comm& comm) {
    const int W = comm.size(), me = comm.rank();
    const int64_t E = 8, k = 2, dim = 6, T = 37 + 5 * me;
    CounterRng rng(uint64_t(90 + me), 4);
    uint64_t draw = 0;
    auto uniform = [&] { return float(rng.bits(draw++) % 2001) / 1000.f - 1.f; };
    std::vector<float> x(size_t(T * dim)), gates(size_t(T * k));
    std::vector<int32_t> topk(size_t(T * k));
    for (auto& v : x) v = uniform();
    for (auto& g : gates) g = uniform();
    for (int64_t t = 0; t < T; ++t) {
        const int32_t a = int32_t(rng.bits(draw++) % E);
        const int32_t b = int32_t((a + 1 + rng.bits(draw++) % (E - 1)) % E);
        topk[size_t(t * k)] = a;
        topk[size_t(t * k + 1)] = t % 7 == 3 ? -1 : b;  // some choices dropped (capacity)
    }
    const EpDispatchPlan plan = plan_ep_dispatch(comm, topk.data(), T, k, E);
    std::vector<float> recv(size_t(plan.total_recv() * dim));
    ep_dispatch(comm, plan, x.data(), k, dim, recv.data());
    for (int64_t r = 0; r < plan.total_recv(); ++r) {
        const int32_t e = plan.recv_expert[size_t(r)];
        ASSERT_EQ(e / (E / W), me) << "row of expert " << e << " arrived at rank " << me;
        for (int64_t c = 0; c < dim; ++c)
            recv[size_t(r * dim + c)] = float(e + 1) * recv[size_t(r * dim + c)] + float(e);
    }
    std::vector<float> y(size_t(T * dim), 0.f), ref(size_t(T * dim), 0.f);
    ep_combine(comm, plan, recv.data(), gates.data(), T, k, dim, y.data());
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = topk[size_t(t * k + j)];
            if (e < 0) continue;
            for (int64_t c = 0; c < dim; ++c)
                ref[size_t(t * dim + c)] +=
                    gates[size_t(t * k + j)] * (float(e + 1) * x[size_t(t * dim + c)] + float(e));
        }
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], ref[i]) << "element " << i;
    // Rows are conserved over the group.
    double rows[2] = {0, double(plan.total_recv())};
    for (int64_t s : plan.send_rows) rows[0] += double(s);
    comm.allreduce_sum(rows, 2);
    EXPECT_EQ(rows[0], rows[1]);
}

}  // namespace sparsetron::test
