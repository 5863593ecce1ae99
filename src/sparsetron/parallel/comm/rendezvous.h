// A small TCP rendezvous: rank 0 hands the same bytes (NCCL's unique id) to every other rank of
// the job, before any communicator exists. Rank 0 listens on `port` of all interfaces; the others
// connect to `host:port`, retrying until `timeout_s`. Used by the NCCL launch (parallel/nccl/).
#pragma once

#include <string>

#include "sparsetron/parallel/comm/launch_env.h"

namespace sparsetron {

struct RendezvousAddress {
    std::string host = "127.0.0.1";
    int port = 29500;
};

// MASTER_ADDR / MASTER_PORT when set (torchrun's names), else 127.0.0.1:29500 (one node).
RendezvousAddress rendezvous_address();

// Rank 0 sends `payload` to ranks 1 .. world-1 and returns it; every other rank returns what it
// received. Throws with the address and what failed (no connection within timeout_s, a short
// read, a rank number outside the job or seen twice).
std::string rendezvous_broadcast(const LaunchEnv& env, const RendezvousAddress& at,
                                 const std::string& payload, double timeout_s = 120);

}  // namespace sparsetron
