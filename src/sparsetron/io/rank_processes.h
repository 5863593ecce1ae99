// Which processes run a training output directory: every rank writes OUT/.ranks/rank<N> (its PID
// and host) when it starts, so `sparsetron stop OUT` can ask the run to stop by signalling the
// ranks themselves. Under mpirun that is the graceful path: a signal to mpirun reaches the ranks
// only as the first step of its kill sequence (SIGTERM, then SIGKILL a second later by default).
#pragma once

#include <string>
#include <vector>

namespace sparsetron {

struct RankProcess {
    int rank = 0;
    long pid = 0;
    std::string host;
};

// This machine's host name (as the rank files record it).
std::string this_host_name();

// Records this process as `rank` of the run writing `out_dir`.
void write_rank_process(const std::string& out_dir, int rank);

// The rank files under `out_dir`, by rank (unreadable or malformed ones are skipped).
std::vector<RankProcess> read_rank_processes(const std::string& out_dir);

// Whether `p` runs on this host and is a live sparsetron process (not a PID reused since).
bool is_live_sparsetron_process(const RankProcess& p);

}  // namespace sparsetron
