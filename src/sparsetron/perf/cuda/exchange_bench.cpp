#include "sparsetron/perf/exchange_bench.h"

#include <algorithm>
#include <vector>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/error.h"
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/parallel/expert/expert_exchange.h"

namespace sparsetron {
namespace {

// Row i of rank p, column d: small integers over 64, exact in bf16, different per rank and row.
bf16 value(int p, int64_t i, int64_t d) {
    return float_to_bf16(float((p * 131 + i * 7 + d * 3) % 251 - 125) / 64.f);
}

struct DeviceBuffer {
    explicit DeviceBuffer(size_t bytes) : p(device_alloc(bytes)) {}
    ~DeviceBuffer() { device_free(p); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void* p;
};

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

ExchangeBenchResult bench_expert_exchange(Comm& comm, const ExchangeBenchOptions& o) {
    const int W = comm.size(), me = comm.rank();
    ST_CHECK(comm.on_device(), "bench-exchange needs GPUs under a launcher (NCCL)");
    ST_CHECK(o.experts % W == 0 && o.rows % o.experts == 0, "bench-exchange: rows (", o.rows,
             ") must split evenly over ", o.experts, " experts, and the experts over ", W,
             " ranks");
    const int64_t E = o.experts, el = E / W, per_expert = o.rows / E, dim = o.dim;
    const size_t row_bytes = size_t(dim) * sizeof(bf16);
    cuda::CudaSession session;
    const ExecContext& ctx = session.ctx();
    std::vector<bf16> x(size_t(o.rows * dim));
    for (int64_t i = 0; i < o.rows; ++i)
        for (int64_t d = 0; d < dim; ++d) x[size_t(i * dim + d)] = value(me, i, d);
    std::vector<int32_t> offsets(size_t(E + 1));
    for (int64_t e = 0; e <= E; ++e) offsets[size_t(e)] = int32_t(e * per_expert);
    DeviceBuffer dx(x.size() * sizeof(bf16)), dy(size_t(W) * x.size() * sizeof(bf16)),
        dback(x.size() * sizeof(bf16)), doff(offsets.size() * 4), dall(size_t(W * (E + 1)) * 4),
        drecv(size_t(el + 1) * 4), dnccl(x.size() * sizeof(bf16));
    copy_to_device(dx.p, x.data(), x.size() * sizeof(bf16));
    copy_to_device(doff.p, offsets.data(), offsets.size() * 4);
    auto* xs = static_cast<bf16*>(dx.p);
    auto* ys = static_cast<bf16*>(dy.p);
    auto* off = static_cast<int32_t*>(doff.p);
    auto* all = static_cast<int32_t*>(dall.p);
    auto* recv = static_cast<int32_t*>(drecv.p);
    const int64_t received = W * per_expert * el;
    const int64_t xbytes = int64_t(x.size() * sizeof(bf16)), ybytes = received * int64_t(row_bytes);
    // The plan's bounds for this routing: a rank sends every row and receives `received`; the
    // uniform routing sends rows / W to each rank (the NCCL exchange's blocks).
    const cuda::ExchangeShape shape{
        .experts = E, .max_rows = std::max(o.rows, received), .pair_rows = o.rows / W, .dim = dim};

    // A dispatch then a combine; the owner layout holds, per local expert j, source 0's rows,
    // then source 1's, ...; the combine brings every row back to where it was.
    const auto check = [&](cuda::ExpertExchange& ex) {
        const char* t = transport_name(ex.transport());
        cuda::copy_2d(ctx, ex.begin_send(ctx), xbytes, xs, xbytes, xbytes, 1);
        ex.dispatch(ctx, off, all, recv, ys);
        cuda::copy_2d(ctx, ex.begin_send(ctx), ybytes, ys, ybytes, ybytes, 1);
        ex.combine(ctx, all, static_cast<bf16*>(dback.p));
        session.synchronize();
        std::vector<bf16> y(size_t(received * dim)), back(x.size());
        copy_to_host(y.data(), dy.p, y.size() * sizeof(bf16));
        copy_to_host(back.data(), dback.p, back.size() * sizeof(bf16));
        int64_t at = 0;
        for (int64_t j = 0; j < el; ++j)
            for (int p = 0; p < W; ++p)
                for (int64_t r = 0; r < per_expert; ++r, ++at) {
                    const int64_t src = (me * el + j) * per_expert + r;
                    for (int64_t d = 0; d < dim; ++d)
                        ST_CHECK(y[size_t(at * dim + d)].bits == value(p, src, d).bits,
                                 "bench-exchange (", t, "): rank ", me,
                                 " received a wrong value at row ", at, " (local expert ", j,
                                 ", from rank ", p, "), column ", d);
                }
        for (size_t i = 0; i < x.size(); ++i)
            ST_CHECK(back[i].bits == x[i].bits, "bench-exchange (", t, "): rank ", me,
                     " got a wrong value back at element ", i, " after dispatch + combine");
    };
    // Timed as the model runs it: the rows are already where begin_send points (the MoE
    // layer's kernels write them there); x again, since the combine left y's rows there.
    const auto time = [&](cuda::ExpertExchange& ex) {
        cuda::copy_2d(ctx, ex.begin_send(ctx), xbytes, xs, xbytes, xbytes, 1);
        ex.dispatch(ctx, off, all, recv, ys);
        return median(session.time_ms(
            [&] {
                ex.begin_send(ctx);
                ex.dispatch(ctx, off, all, recv, ys);
            },
            o.iters, o.warmup));
    };

    ExchangeBenchResult r;
    r.ranks = W, r.rows = o.rows, r.dim = dim, r.experts = E, r.gpu = cuda_device_name();
    r.peer_bytes = double(o.rows - o.rows / W) * double(row_bytes);
    // NVLink only where every rank shares this node (the IPC mapping needs it).
    if (choose_exchange_transport("auto", comm.allgather(this_host_id())) ==
        ExchangeTransport::Nvlink) {
        const auto ex = cuda::make_expert_exchange(ExchangeTransport::Nvlink, comm, shape);
        check(*ex);
        r.exchange_ms = time(*ex);
    }
    {
        const auto ex = cuda::make_expert_exchange(ExchangeTransport::Nccl, comm, shape);
        check(*ex);
        r.nccl_exchange_ms = time(*ex);
    }
    // The same blocks by a bare NCCL all-to-all: rows / W rows to every rank (uniform routing
    // sends exactly that).
    const int64_t block = (o.rows / W) * int64_t(row_bytes);
    r.nccl_ms = median(session.time_ms(
        [&] { comm.device_alltoall(dx.p, dnccl.p, block, ctx.stream); }, o.iters, o.warmup));
    r.exchange_gbps = r.exchange_ms > 0 ? r.peer_bytes / (r.exchange_ms * 1e6) : 0.0;
    r.nccl_exchange_gbps = r.peer_bytes / (r.nccl_exchange_ms * 1e6);
    r.nccl_gbps = r.peer_bytes / (r.nccl_ms * 1e6);
    return r;
}

}  // namespace sparsetron
