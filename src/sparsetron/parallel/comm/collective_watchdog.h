// A deadline on every collective (Megatron's distributed_timeout_minutes; NCCL's watchdog
// semantics): a rank that waits longer than the timeout in one collective prints which rank
// stopped answering and exits, and the launcher then ends every rank (no rank spins forever
// behind a stopped or dead one). MPI ranks watch each collective; GPU ranks watch the host's
// NCCL collectives and the wait for each device step, whose NCCL collectives run inside it.
//
// Naming the rank: every rank's watchdog thread rewrites a heartbeat file (its PID, how many
// collectives it has entered and the one it is in) in a directory the ranks share, twice a
// second. A stopped process stops beating; a rank stuck outside the collectives beats with a
// lower count. Without a shared directory the message says only that a rank did not arrive.
#pragma once

#include <string>

namespace sparsetron {

class CollectiveWatchdog {
  public:
    // The process's watchdog (all its communicators share it).
    static CollectiveWatchdog& instance();
    // Starts watching: `timeout_s` per collective (0 turns it off); heartbeats under
    // `heartbeat_dir`/.heartbeat/ when it is not empty. `rank` is the world rank.
    void configure(double timeout_s, const std::string& heartbeat_dir, int rank, int ranks);

    // Marks one collective (or a wait that holds collectives) for its lifetime; a scope inside
    // another is part of the outer one.
    class Scope {
      public:
        explicit Scope(const char* op);
        ~Scope();
        Scope(const Scope&) = delete;
        Scope& operator=(const Scope&) = delete;
    };

    // The line a timed-out rank prints (exposed for tests): `waited_s` in `op` number `seq`,
    // read against the heartbeat files under `dir` (may be empty).
    static std::string timeout_message(int rank, const std::string& op, long seq, double waited_s,
                                       double timeout_s, const std::string& dir, int ranks);

  private:
    CollectiveWatchdog() = default;
};

}  // namespace sparsetron
