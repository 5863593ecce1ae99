// Which transport carries the expert-parallel exchange (expert_exchange.h), from the recipe's
// moe_expert_exchange and where the expert-parallel group's ranks run. Plain C++: chosen and
// tested without a GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsetron {

enum class ExchangeTransport {
    Nvlink,  // CUDA IPC: every peer's memory mapped, rows pulled over NVLink (one node)
    Nccl,    // NCCL grouped send/recv of fixed-size blocks (any placement)
};

const char* transport_name(ExchangeTransport t);

// setting: "auto" | "nvlink" | "nccl" (the recipe key). hosts: every expert-parallel rank's host
// (this_host_id(), in rank order). auto takes NVLink when every rank is on one host and NCCL
// otherwise; nvlink across hosts is refused, naming two ranks on different hosts.
ExchangeTransport choose_exchange_transport(const std::string& setting,
                                            const std::vector<uint64_t>& hosts);

// A hash of this machine's host name (two processes on one node agree).
uint64_t this_host_id();

}  // namespace sparsetron
