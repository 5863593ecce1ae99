// `sparsetron bench-exchange`: under a launcher with GPUs, checks the expert-parallel exchange and
// times it against a plain NCCL all-to-all of the same bytes.
#include <cstdio>
#include <fstream>
#include <memory>

#include "command.h"
#include "sparsetron/core/error.h"
#include "sparsetron/perf/exchange_bench.h"

namespace sparsetron::cli {

Run add_bench_exchange(CLI::App& app) {
    struct Options {
        ExchangeBenchOptions x;
        JsonOutput json;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand(
        "bench-exchange",
        "Under a launcher with GPUs: check the expert-parallel exchange's transports (NVLink, "
        "NCCL) and time them against a plain NCCL all-to-all of the same bytes");
    c->add_option("--rows", o->x.rows, "Routed rows per rank (default 32768: 4096 tokens x 8)");
    c->add_option("--dim", o->x.dim, "bf16 values per row (default 6144)");
    c->add_option("--experts", o->x.experts, "Experts, uniform routing (default 16)");
    c->add_option("--warmup", o->x.warmup, "Untimed exchanges first (default 3)");
    c->add_option("--iters", o->x.iters, "Timed exchanges (default 20)");
    add_json_output(c, o->json, "The result");
    return [o] {
        connect_gpus_if_launched(Device::CUDA);
        ST_CHECK(launch_comm() && launch_comm()->size() > 1,
                 "bench-exchange runs under a launcher with 2 or more processes (one GPU "
                 "each), e.g. scripts/launch-local.sh 2 sparsetron bench-exchange");
        const ExchangeBenchResult x = bench_expert_exchange(*launch_comm(), o->x);
        if (launch_comm()->rank() != 0) return 0;
        std::printf(
            "expert exchange | %s x %d | %lld rows x %lld bf16 per rank, %lld experts "
            "(uniform) | %.1f MB to peers per rank\n"
            "check: dispatch and combine delivered every row bit for bit (verified%s)\n"
            "%-28s %10s %12s\n",
            x.gpu.c_str(), x.ranks, static_cast<long long>(x.rows), static_cast<long long>(x.dim),
            static_cast<long long>(x.experts), x.peer_bytes / 1e6,
            x.exchange_ms > 0 ? ", both transports" : ", NCCL: the ranks span hosts", "",
            "median ms", "GB/s to peers");
        const auto line = [&](const char* what, double ms, double gbps) {
            std::printf("%-28s %10.3f %12.1f (%.2fx the all-to-all's time)\n", what, ms, gbps,
                        ms / x.nccl_ms);
        };
        if (x.exchange_ms > 0) line("exchange, NVLink (CUDA IPC)", x.exchange_ms, x.exchange_gbps);
        line("exchange, NCCL blocks", x.nccl_exchange_ms, x.nccl_exchange_gbps);
        line("NCCL send/recv all-to-all", x.nccl_ms, x.nccl_gbps);
        o->json.write(x.to_json());
        return 0;
    };
}

}  // namespace sparsetron::cli
