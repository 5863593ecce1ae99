#include "sparsetron/perf/exchange_bench.h"

#include <nlohmann/json.hpp>

namespace sparsetron {

std::string ExchangeBenchResult::to_json() const {
    nlohmann::json j;
    j["ranks"] = ranks, j["rows"] = rows, j["dim"] = dim, j["experts"] = experts;
    j["peer_bytes"] = peer_bytes, j["gpu"] = gpu;
    j["exchange_ms"] = exchange_ms, j["nccl_exchange_ms"] = nccl_exchange_ms;
    j["nccl_alltoall_ms"] = nccl_ms;
    j["exchange_gbps"] = exchange_gbps, j["nccl_exchange_gbps"] = nccl_exchange_gbps;
    j["nccl_alltoall_gbps"] = nccl_gbps;
    return j.dump();
}

}  // namespace sparsetron
