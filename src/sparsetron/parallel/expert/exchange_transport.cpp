#include "sparsetron/parallel/expert/exchange_transport.h"

#include <unistd.h>

#include <climits>

#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"

namespace sparsetron {

const char* transport_name(ExchangeTransport t) {
    return t == ExchangeTransport::Nvlink ? "nvlink" : "nccl";
}

ExchangeTransport choose_exchange_transport(const std::string& setting,
                                            const std::vector<uint64_t>& hosts) {
    ST_CHECK(setting == "auto" || setting == "nvlink" || setting == "nccl",
             "moe_expert_exchange: \"", setting, "\" is not one of auto, nvlink, nccl");
    if (setting == "nccl") return ExchangeTransport::Nccl;
    size_t other = 0;
    while (other < hosts.size() && hosts[other] == hosts.front()) ++other;
    const bool one_host = other == hosts.size();
    if (setting == "auto") return one_host ? ExchangeTransport::Nvlink : ExchangeTransport::Nccl;
    ST_CHECK(one_host, "moe_expert_exchange: nvlink maps every expert-parallel peer's GPU memory, ",
             "so the group must run on one node; ranks 0 and ", other,
             " of the expert-parallel group are on different hosts (use nccl or auto)");
    return ExchangeTransport::Nvlink;
}

uint64_t this_host_id() {
    char name[HOST_NAME_MAX + 1] = {};
    ST_CHECK(gethostname(name, sizeof name - 1) == 0, "gethostname failed");
    return hash_name(name);
}

}  // namespace sparsetron
