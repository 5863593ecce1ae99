// The expert exchanges (parallel/expert_exchange.h) on one GPU:
// - W ranks as W threads, each with its own stream, joined by a communicator whose device
//   all-gather and all-to-all copy between the threads' buffers: the pack and unpack kernels
//   and the layouts against rows computed on the host, for random routings under a capacity
//   bound and a skewed dropless one; the NVLink transport also with a late rank that runs a GEMM
//   while the others wait for it;
// - one rank of each transport (NCCL through a real communicator, sending to itself; CUDA IPC
//   on its own region), dispatch and combine captured in a CUDA graph and replayed on new rows.
// Both transports against each other on two GPUs: DataParallelGpu.ExpertExchangeDeliversEveryRow*
// (test_multigpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/harness.h"
#include "sparsetron/parallel/comm/launch_env.h"

#if SPARSETRON_WITH_CUDA
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/cuda/step_graph.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/parallel/expert/expert_exchange.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaExpertExchange, Skipped) {
    GTEST_SKIP() << "built without CUDA: GPU tests run on the GPU machine";
}
#else

namespace {

// Threads standing in for the ranks of one job: each publishes its buffer, waits for the
// others, then copies what it receives on its own stream.
struct ThreadJob {
    explicit ThreadJob(int w) : ranks(w), bar(w), sent(size_t(w)) {}
    int ranks;
    std::barrier<> bar;
    std::vector<const char*> sent;
};

class ThreadComm final : public Comm {
  public:
    ThreadComm(ThreadJob& job, int rank, const cuda::CudaSession& s)
        : job_(job), rank_(rank), s_(s) {}
    int rank() const override { return rank_; }
    int size() const override { return job_.ranks; }
    bool on_device() const override { return true; }
    void device_allgather(void* data, int64_t bytes, void*) override {
        // Every rank's block r of its own buffer is rank r's contribution.
        exchange(
            data,
            [&](int r) {
                return std::pair{r * bytes, r * bytes};
            },
            data, bytes);
    }
    void device_alltoall(const void* send, void* recv, int64_t bytes, void*) override {
        // Block me of rank r's send lands in block r of this rank's receive.
        exchange(
            send,
            [&](int r) {
                return std::pair{int64_t(rank_) * bytes, r * bytes};
            },
            recv, bytes);
    }
    // The IPC exchange maps its peers' regions with a host broadcast; no exchange needs the
    // other host collectives.
    void broadcast(void* data, int64_t bytes, int root) override {
        job_.sent[size_t(rank_)] = static_cast<const char*>(data);
        job_.bar.arrive_and_wait();
        if (rank_ != root) std::memcpy(data, job_.sent[size_t(root)], size_t(bytes));
        job_.bar.arrive_and_wait();  // the root's data stays until every rank has read it
    }
    void allreduce_sum(float*, int64_t) override { unused(); }
    void allreduce_sum(double*, int64_t) override { unused(); }
    std::vector<uint64_t> allgather(uint64_t) override { unused(); }
    void alltoallv(const void*, const std::vector<int64_t>&, void*,
                   const std::vector<int64_t>&) override {
        unused();
    }
    std::unique_ptr<Comm> split(int, int) override { unused(); }
    [[noreturn]] void abort(int) override { unused(); }
    std::string name() const override { return "threads"; }

  private:
    [[noreturn]] static void unused() { throw Error("ThreadComm: a host collective was called"); }
    // at(r): (offset in rank r's buffer, offset in this rank's destination).
    template <typename At>
    void exchange(const void* mine, At at, void* dst, int64_t bytes) {
        s_.synchronize();  // this rank's data is written
        job_.sent[size_t(rank_)] = static_cast<const char*>(mine);
        job_.bar.arrive_and_wait();
        for (int r = 0; r < job_.ranks; ++r) {
            if (r == rank_ && mine == dst) continue;
            const auto [from, to] = at(r);
            cuda::copy_2d(s_.ctx(), static_cast<char*>(dst) + to, bytes,
                          job_.sent[size_t(r)] + from, bytes, bytes, 1);
        }
        s_.synchronize();
        job_.bar.arrive_and_wait();  // nobody overwrites a buffer another rank still reads
    }
    ThreadJob& job_;
    int rank_;
    const cuda::CudaSession& s_;
};

bf16 row_value(int tag, int rank, int64_t row, int64_t d) {
    return float_to_bf16(float((tag * 97 + rank * 131 + row * 7 + d * 3) % 251 - 125) / 64.f);
}

// One routing: counts[p][e] rows of rank p for expert e.
struct Routing {
    int W;
    int64_t E, dim, pair_rows, max_rows;
    std::vector<std::vector<int32_t>> counts;
    int64_t el() const { return E / W; }
    std::vector<int32_t> offsets(int p) const {
        std::vector<int32_t> o(size_t(E + 1), 0);
        for (int64_t e = 0; e < E; ++e)
            o[size_t(e + 1)] = o[size_t(e)] + counts[size_t(p)][size_t(e)];
        return o;
    }
    // Source rows of rank p that reach owner q: the first pair_rows of those for q's experts.
    int32_t pair_end(int p, int q) const {
        const auto o = offsets(p);
        return std::min<int32_t>(o[size_t((q + 1) * el())], o[size_t(q * el())] + pair_rows);
    }
    bool over_budget(int q) const {
        for (int p = 0; p < W; ++p)
            if (offsets(p)[size_t((q + 1) * el())] - offsets(p)[size_t(q * el())] > pair_rows)
                return true;
        return false;
    }
    // Owner layout of rank q: (source p, source row i) per owner row.
    std::vector<std::pair<int, int64_t>> owner_rows(int q) const {
        std::vector<std::pair<int, int64_t>> rows;
        for (int64_t j = 0; j < el(); ++j)
            for (int p = 0; p < W; ++p) {
                const auto o = offsets(p);
                const int32_t end = std::min(o[size_t(q * el() + j + 1)], pair_end(p, q));
                for (int32_t i = o[size_t(q * el() + j)]; i < end; ++i) rows.emplace_back(p, i);
            }
        return rows;
    }
};

struct RankResult {
    int32_t over_budget = -1;
    std::vector<int32_t> all, recv;
    std::vector<bf16> y, back, y_again;
    std::string error;
};

// Every rank: dispatch rows tagged 1, combine owner rows tagged 2, dispatch_again rows tagged 3.
// Rank `late` (if any) starts its exchanges after the others are waiting for it, and first runs a
// GEMM whose kernels each need a whole SM (its registers or shared memory).
std::vector<RankResult> run_threads(const Routing& rt, ExchangeTransport transport, int late = -1) {
    const int W = rt.W;
    const int64_t E = rt.E, dim = rt.dim, el = rt.el();
    ThreadJob job(W);
    std::vector<RankResult> out(static_cast<size_t>(W));
    std::vector<std::thread> threads;
    for (int me = 0; me < W; ++me)
        threads.emplace_back([&, me] {
            RankResult& res = out[size_t(me)];
            try {
                cuda::CudaSession s;
                const ExecContext& ctx = s.ctx();
                // The late rank's GEMM operands, allocated before any exchange can wait on it.
                const int64_t g = me == late ? 4096 : 0;
                DeviceArray<bf16> ga(g * g), gb(g * g), gc(g * g);
                ThreadComm comm(job, me, s);
                const cuda::ExchangeShape shape{
                    .experts = E, .max_rows = rt.max_rows, .pair_rows = rt.pair_rows, .dim = dim};
                auto ex = cuda::make_expert_exchange(transport, comm, shape);
                const std::vector<int32_t> off = rt.offsets(me);
                const int64_t sent = off.back(), recvd = int64_t(rt.owner_rows(me).size());
                const auto rows = [&](int tag, int64_t n) {
                    std::vector<bf16> v(size_t(n * dim));
                    for (int64_t i = 0; i < n; ++i)
                        for (int64_t d = 0; d < dim; ++d)
                            v[size_t(i * dim + d)] = row_value(tag, me, i, d);
                    return v;
                };
                DeviceArray<int32_t> doff(off), all(W * (E + 1)), recv(el + 1);
                DeviceArray<bf16> x(rows(1, sent)), z(rows(2, recvd)), x3(rows(3, sent));
                DeviceArray<bf16> y(rt.max_rows * dim), back(sent * dim), y3(rt.max_rows * dim);
                const int64_t xb = sent * dim * 2, zb = recvd * dim * 2;
                if (me == late) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(300));
                    cuda::gemm(ctx, false, true, g, g, g, 1.f, ga, g, gb, g, 0.f, gc, g);
                }
                cuda::copy_2d(ctx, ex->begin_send(ctx), xb, x, xb, xb, 1);
                ex->dispatch(ctx, doff, all, recv, y);
                cuda::copy_2d(ctx, ex->begin_send(ctx), zb, z, zb, zb, 1);
                ex->combine(ctx, all, back);
                cuda::copy_2d(ctx, ex->begin_send(ctx), xb, x3, xb, xb, 1);
                ex->dispatch_again(ctx, all, y3);
                s.synchronize();
                cuda::download(ctx, &res.over_budget, ex->over_budget(), sizeof(int32_t));
                res.all = all.download(), res.recv = recv.download();
                res.y = y.download(), res.back = back.download(), res.y_again = y3.download();
            } catch (const std::exception& e) {
                res.error = e.what();
            }
        });
    for (auto& t : threads) t.join();
    return out;
}

void check_routing(const Routing& rt, ExchangeTransport transport = ExchangeTransport::Nccl,
                   int late = -1) {
    const std::vector<RankResult> got = run_threads(rt, transport, late);
    const int64_t dim = rt.dim;
    const bf16 poison = {0xFFFF};
    for (int q = 0; q < rt.W; ++q) {
        const RankResult& r = got[size_t(q)];
        ASSERT_TRUE(r.error.empty()) << "rank " << q << ": " << r.error;
        EXPECT_EQ(r.over_budget, rt.over_budget(q) ? 1 : 0) << "rank " << q;
        // Every rank's offsets, the owner layout's per-expert starts.
        for (int p = 0; p < rt.W; ++p)
            for (int64_t e = 0; e <= rt.E; ++e)
                ASSERT_EQ(r.all[size_t(p * (rt.E + 1) + e)], rt.offsets(p)[size_t(e)]);
        const auto owner = rt.owner_rows(q);
        int32_t at = 0;
        for (int64_t j = 0; j < rt.el(); ++j) {
            ASSERT_EQ(r.recv[size_t(j)], at) << "rank " << q << " local expert " << j;
            for (int p = 0; p < rt.W; ++p) {
                const auto o = rt.offsets(p);
                at += std::max(0, std::min(o[size_t(q * rt.el() + j + 1)], rt.pair_end(p, q)) -
                                      o[size_t(q * rt.el() + j)]);
            }
        }
        ASSERT_EQ(r.recv[size_t(rt.el())], at);
        ASSERT_EQ(size_t(at), owner.size());
        // Owner rows: source p's row i, as tagged by p; nothing written past them.
        for (size_t o = 0; o < owner.size(); ++o)
            for (int64_t d = 0; d < dim; ++d) {
                const auto [p, i] = owner[o];
                ASSERT_EQ(r.y[o * size_t(dim) + size_t(d)].bits, row_value(1, p, i, d).bits)
                    << "rank " << q << " owner row " << o << " (rank " << p << "'s row " << i
                    << ")";
                ASSERT_EQ(r.y_again[o * size_t(dim) + size_t(d)].bits, row_value(3, p, i, d).bits);
            }
        for (size_t v = owner.size() * size_t(dim); v < r.y.size(); ++v)
            ASSERT_EQ(r.y[v].bits, poison.bits) << "rank " << q << " wrote past its owner rows";
    }
    // Combine: source p's row i comes back from owner q's row holding it (tagged by q); a row
    // over the pair's budget does not come back (its source's buffer keeps what it held).
    std::vector<std::vector<bool>> returned(size_t(rt.W));
    for (int p = 0; p < rt.W; ++p) returned[size_t(p)].assign(size_t(rt.offsets(p).back()), false);
    for (int q = 0; q < rt.W; ++q) {
        const auto owner = rt.owner_rows(q);
        for (size_t o = 0; o < owner.size(); ++o) {
            const auto [p, i] = owner[o];
            returned[size_t(p)][size_t(i)] = true;
            for (int64_t d = 0; d < dim; ++d)
                ASSERT_EQ(got[size_t(p)].back[size_t(i * dim + d)].bits,
                          row_value(2, q, int64_t(o), d).bits)
                    << "rank " << p << "'s row " << i << " back from rank " << q;
        }
    }
    for (int p = 0; p < rt.W; ++p)
        for (size_t i = 0; i < returned[size_t(p)].size(); ++i)
            if (!returned[size_t(p)][i]) {
                ASSERT_EQ(got[size_t(p)].back[i * size_t(dim)].bits, poison.bits)
                    << "rank " << p << "'s row " << i << " was over the budget but came back";
            }
}

}  // namespace

// Capacity-bound routing: each expert takes at most `cap` rows from a source, so one source
// sends one owner at most El x cap rows (the NCCL blocks' size).
TEST(CudaExpertExchange, NcclBlocksCarryEveryRowUnderACapacity) {
    REQUIRE_GPU();
    std::mt19937 rng(17);
    Routing rt{.W = 4, .E = 8, .dim = 40, .pair_rows = 0, .max_rows = 0, .counts = {}};
    const int32_t cap = 5;
    rt.pair_rows = rt.el() * cap;
    for (int p = 0; p < rt.W; ++p) {
        std::vector<int32_t> c(size_t(rt.E));
        for (auto& v : c) v = std::uniform_int_distribution<int32_t>(0, cap)(rng);
        c[size_t(p)] = cap;  // at least one full expert per source
        rt.counts.push_back(c);
    }
    rt.max_rows = rt.W * rt.pair_rows;
    check_routing(rt);
}

namespace {

// Dropless routing skewed to one owner: a source may send all its rows to one rank, and an empty
// pair (no rows) still exchanges its block.
Routing skewed_dropless_routing() {
    std::mt19937 rng(5);
    Routing rt{.W = 3, .E = 6, .dim = 264, .pair_rows = 23, .max_rows = 3 * 23, .counts = {}};
    for (int p = 0; p < rt.W; ++p) {
        std::vector<int32_t> c(size_t(rt.E), 0);
        // Rank 0 sends all 23 rows to rank 2's experts; the others spread theirs.
        if (p == 0)
            c[4] = 20, c[5] = 3;
        else
            for (int i = 0; i < 23; ++i)
                ++c[size_t(std::uniform_int_distribution<int64_t>(0, rt.E - 1)(rng))];
        rt.counts.push_back(c);
    }
    return rt;
}

}  // namespace

TEST(CudaExpertExchange, NcclBlocksCarryASkewedDroplessRouting) {
    REQUIRE_GPU();
    check_routing(skewed_dropless_routing());
}

// The IPC exchange between ranks that are threads of one process (each maps the others' regions
// by pointer, not by IPC handle): the same rows as the NCCL blocks.
TEST(CudaExpertExchange, IpcExchangeBetweenThreadsCarriesASkewedDroplessRouting) {
    REQUIRE_GPU();
    check_routing(skewed_dropless_routing(), ExchangeTransport::Nvlink);
}

// The same with rank 1 late and busy: the others' exchanges wait for it in one block each, so
// its GEMM finds free SMs and it then publishes. (A pull kernel spinning on every SM kept the
// GEMM from starting: the exchange trapped after a minute.)
TEST(CudaExpertExchange, IpcExchangeWaitsForABusyLatePeerWithoutHoldingEverySm) {
    REQUIRE_GPU();
    check_routing(skewed_dropless_routing(), ExchangeTransport::Nvlink, 1);
}

// A receive budget below the dropless bound: rank 0 sends rank 2's experts 30 rows (of the 32 it
// publishes) where the pair's budget is 12. The first 12 (in source order, across both of rank 2's
// experts) move, the rest are dropped, rank 2's over-budget flag is set (the others' are not), and
// the other pairs are exchanged as before.
TEST(CudaExpertExchange, NcclBlocksDropRowsOverThePairBudgetAndFlagThem) {
    REQUIRE_GPU();
    std::mt19937 rng(11);
    Routing rt{.W = 3, .E = 6, .dim = 24, .pair_rows = 12, .max_rows = 36, .counts = {}};
    for (int p = 0; p < rt.W; ++p) {
        std::vector<int32_t> c(size_t(rt.E), 0);
        if (p == 0)
            c[1] = 2, c[4] = 9, c[5] = 21;  // 30 rows for rank 2 (experts 4, 5)
        else
            for (int i = 0; i < 12; ++i)
                ++c[size_t(std::uniform_int_distribution<int64_t>(0, rt.E - 1)(rng))];
        rt.counts.push_back(c);
    }
    ASSERT_TRUE(rt.over_budget(2));
    ASSERT_FALSE(rt.over_budget(0) || rt.over_budget(1));
    check_routing(rt);
}

namespace {

// One rank, captured in a graph: the replay moves the rows the buffers hold at replay time. One
// rank owns every expert, so the owner layout is the source layout.
void one_rank_replays_in_a_graph(ExchangeTransport t, Comm& comm) {
    const int64_t E = 4, dim = 16;
    const std::vector<int32_t> off = {0, 3, 3, 7, 10};
    const int64_t R = off.back();
    cuda::CudaSession s;
    const ExecContext& ctx = s.ctx();
    auto ex = cuda::make_expert_exchange(t, comm,
                                         {.experts = E, .max_rows = R, .pair_rows = R, .dim = dim});
    ASSERT_EQ(ex->transport(), t);
    const auto rows = [&](int tag) {
        std::vector<bf16> v(size_t(R * dim));
        for (int64_t i = 0; i < R; ++i)
            for (int64_t d = 0; d < dim; ++d) v[size_t(i * dim + d)] = row_value(tag, 0, i, d);
        return v;
    };
    DeviceArray<int32_t> doff(off), all(E + 1), recv(E + 1);
    DeviceArray<bf16> x(rows(1)), y(R * dim), back(R * dim);
    const int64_t b = R * dim * 2;
    cuda::StepGraph graph(s);
    graph.begin_capture();
    cuda::copy_2d(ctx, ex->begin_send(ctx), b, x, b, b, 1);
    ex->dispatch(ctx, doff, all, recv, y);
    cuda::copy_2d(ctx, ex->begin_send(ctx), b, y, b, b, 1);
    ex->combine(ctx, all, back);
    graph.end_capture();
    for (int tag : {4, 9}) {
        x.upload(rows(tag));
        graph.replay();
        s.synchronize();
        const auto want = rows(tag), gy = y.download(), gb = back.download();
        for (size_t v = 0; v < want.size(); ++v) {
            ASSERT_EQ(gy[v].bits, want[v].bits) << "replay with rows " << tag << ", value " << v;
            ASSERT_EQ(gb[v].bits, want[v].bits) << "replay with rows " << tag << ", value " << v;
        }
        EXPECT_EQ(recv.download(), off);
        EXPECT_EQ(all.download(), off);
    }
}

}  // namespace

TEST(CudaExpertExchange, NcclExchangeOfOneRankReplaysInAGraph) {
    REQUIRE_GPU();
    std::unique_ptr<Comm> comm;
    try {
        comm = make_nccl_comm(LaunchEnv{});  // send/recv to itself through NCCL
    } catch (const Error& e) {
        GTEST_SKIP() << "no NCCL in this build: " << e.what();
    }
    one_rank_replays_in_a_graph(ExchangeTransport::Nccl, *comm);
    const cuda::ExchangeShape shape{.experts = 4, .max_rows = 10, .pair_rows = 10, .dim = 16};
    EXPECT_EQ(cuda::expert_exchange_bytes(ExchangeTransport::Nccl, shape, 1), 2 * 10 * 16 * 2);
}

TEST(CudaExpertExchange, IpcExchangeOfOneRankReplaysInAGraph) {
    REQUIRE_GPU();
    SingleProcessComm comm;  // its own region, no peer to map
    one_rank_replays_in_a_graph(ExchangeTransport::Nvlink, comm);
}

#endif
