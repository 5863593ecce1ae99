#include "sparsetron/parallel/comm/collective_watchdog.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

using Clock = std::chrono::steady_clock;

struct State {
    std::mutex mu;  // guards op, dir, stopping, rank, ranks
    std::condition_variable wake;
    std::string dir;
    const char* op = nullptr;
    bool stopping = false;
    std::thread thread;
    pid_t owner = 0;  // the process that started the thread (a forked child has no such thread)
    std::atomic<long> seq{0};
    std::atomic<int64_t> since_ns{0};  // when the current collective began; 0: in none
    std::atomic<double> timeout_s{0};
    int rank = 0, ranks = 1;
    bool started = false;  // guarded by mu
};

// Never destroyed: a communicator torn down by a static destructor may still open a Scope, and
// the watchdog thread is joined at exit (stop_at_exit) before anything it reads could go away.
State& state() {
    static State* s = new State;
    return *s;
}

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
}

std::string heartbeat_path(const std::string& dir, int rank) {
    return (fs::path(dir) / ".heartbeat" / ("rank" + std::to_string(rank))).string();
}

void beat(State& s) {
    std::string dir, op;
    int rank = 0;
    {
        std::lock_guard<std::mutex> lock(s.mu);
        dir = s.dir;
        op = s.op ? s.op : "";
        rank = s.rank;
    }
    if (dir.empty()) return;
    std::ofstream out(heartbeat_path(dir, rank), std::ios::trunc);
    out << ::getpid() << " " << s.seq.load() << " " << (op.empty() ? "-" : op) << "\n";
}

void watch() {
    State& s = state();
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(s.mu);
            s.wake.wait_for(lock, std::chrono::milliseconds(500), [&] { return s.stopping; });
            if (s.stopping) return;
        }
        beat(s);
        const int64_t since = s.since_ns.load();
        const double timeout = s.timeout_s.load();
        if (since == 0 || timeout <= 0) continue;
        const double waited = double(now_ns() - since) * 1e-9;
        if (waited < timeout) continue;
        std::string op, dir;
        int rank = 0, ranks = 1;
        {
            std::lock_guard<std::mutex> lock(s.mu);
            op = s.op ? s.op : "a collective";
            dir = s.dir;
            rank = s.rank, ranks = s.ranks;
        }
        const std::string msg = CollectiveWatchdog::timeout_message(rank, op, s.seq.load(), waited,
                                                                    timeout, dir, ranks);
        std::fprintf(stderr, "error: %s\n", msg.c_str());
        std::fflush(stderr);
        // A rank leaving with an error makes mpirun end every rank; no MPI call is safe here
        // while the main thread is inside one.
        ::_exit(1);
    }
}

// Registered with atexit when the thread starts: the thread stops beating and is joined before
// the process's static state is destroyed, so no heartbeat is written after main returns.
void stop_at_exit() {
    State& s = state();
    bool ours = false;
    {
        std::lock_guard<std::mutex> lock(s.mu);
        s.stopping = true;
        ours = s.thread.joinable() && s.owner == ::getpid();
    }
    s.wake.notify_all();
    if (ours) s.thread.join();
}

}  // namespace

CollectiveWatchdog& CollectiveWatchdog::instance() {
    static CollectiveWatchdog w;
    return w;
}

void CollectiveWatchdog::configure(double timeout_s, const std::string& heartbeat_dir, int rank,
                                   int ranks) {
    State& s = state();
    {
        std::lock_guard<std::mutex> lock(s.mu);
        s.dir = heartbeat_dir;
        s.rank = rank;
        s.ranks = ranks;
    }
    if (!heartbeat_dir.empty()) {
        std::error_code ec;
        fs::create_directories(fs::path(heartbeat_dir) / ".heartbeat", ec);
    }
    s.timeout_s.store(timeout_s);
    beat(s);
    std::lock_guard<std::mutex> lock(s.mu);  // ranks run as threads may configure at once
    if (!s.started && timeout_s > 0) {
        s.started = true;
        s.thread = std::thread(watch);
        s.owner = ::getpid();
        std::atexit(stop_at_exit);
    }
}

// Collectives nest (a device step that runs NCCL collectives, a host collective inside a
// split): the outermost one is watched, from when it began.
thread_local int scope_depth = 0;

CollectiveWatchdog::Scope::Scope(const char* op) {
    if (scope_depth++ > 0) return;
    State& s = state();
    {
        std::lock_guard<std::mutex> lock(s.mu);
        s.op = op;
    }
    s.seq.fetch_add(1);
    s.since_ns.store(now_ns());
}

CollectiveWatchdog::Scope::~Scope() {
    if (--scope_depth > 0) return;
    State& s = state();
    s.since_ns.store(0);
    std::lock_guard<std::mutex> lock(s.mu);
    s.op = nullptr;
}

std::string CollectiveWatchdog::timeout_message(int rank, const std::string& op, long seq,
                                                double waited_s, double timeout_s,
                                                const std::string& dir, int ranks) {
    std::ostringstream os;
    os.precision(3);
    os << "rank " << rank << " waited " << waited_s << " s in " << op << " (collective #" << seq
       << "), past distributed_timeout_minutes (" << timeout_s / 60 << " min): ";
    std::string culprits;
    if (!dir.empty()) {
        const auto now = fs::file_time_type::clock::now();
        for (int r = 0; r < ranks; ++r) {
            if (r == rank) continue;
            const std::string path = heartbeat_path(dir, r);
            std::error_code ec;
            const auto when = fs::last_write_time(path, ec);
            std::ifstream in(path);
            long pid = 0, their_seq = 0;
            std::string their_op;
            in >> pid >> their_seq >> their_op;
            const double age = ec ? -1 : std::chrono::duration<double>(now - when).count();
            std::ostringstream why;
            why.precision(3);
            if (ec || !in)
                why << "rank " << r << " (no heartbeat)";
            else if (age > 2.0)  // heartbeats come twice a second
                why << "rank " << r << " (PID " << pid << ": silent for " << age
                    << " s, stopped or dead, last in " << their_op << " #" << their_seq << ")";
            else if (their_op == "-")
                why << "rank " << r << " (PID " << pid << ": running, but in no collective since #"
                    << their_seq << ")";
            else
                continue;
            culprits += (culprits.empty() ? "" : ", ") + why.str();
        }
    }
    if (culprits.empty())
        os << "another rank did not arrive (no heartbeat directory names it)";
    else
        os << culprits << " stopped answering";
    os << "; the job stops";
    return os.str();
}

}  // namespace sparsetron
