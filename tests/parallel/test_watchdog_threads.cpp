// The collective watchdog's threads, built with the watchdog's source alone: under
// ThreadSanitizer in the release build (test_watchdog_tsan) and under AddressSanitizer +
// UndefinedBehaviorSanitizer in the sanitizer build (test_watchdog_threads).
//
// Its heartbeat thread used to be detached and outlive the process's static state: after main
// returned it read a destroyed std::string as the heartbeat directory and wrote files named with
// random bytes into the working directory.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "sparsetron/parallel/comm/collective_watchdog.h"

namespace fs = std::filesystem;
using sparsetron::CollectiveWatchdog;

namespace {

std::string fresh_dir(const std::string& name) {
    const fs::path p = fs::path(SPARSETRON_TEST_TMP) / ("CollectiveWatchdogThreads." + name);
    fs::remove_all(p);
    fs::create_directories(p);
    return p.string();
}

// The program's threads: sanitizer runtimes run threads of their own, which block every signal;
// the program's threads (the watchdog's included) leave SIGTERM unblocked.
int threads_in_this_process() {
    int n = 0;
    for (const auto& task : fs::directory_iterator("/proc/self/task")) {
        std::ifstream status(task.path() / "status");
        unsigned long long blocked = 0;
        for (std::string line; std::getline(status, line);)
            if (line.rfind("SigBlk:", 0) == 0) blocked = std::stoull(line.substr(7), nullptr, 16);
        if (!(blocked >> (SIGTERM - 1) & 1)) ++n;
    }
    return n;
}

// The program's threads before the watchdog started.
int threads_before_watchdog = 0;

// Registered before the watchdog starts, so it runs after the watchdog's own exit handler and
// after the static state it registered is destroyed: by then its thread must be gone.
void exit_with_thread_count() {
    // A joined thread's /proc entry can linger a moment after the join returns; the detached one
    // beat forever.
    for (int waited_ms = 0; waited_ms < 1000; waited_ms += 10) {
        if (threads_in_this_process() == threads_before_watchdog) ::_exit(0);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::fprintf(stderr, "threads: %d before the watchdog, %d after exit\n",
                 threads_before_watchdog, threads_in_this_process());
    ::_exit(3);
}

}  // namespace

// A process that started the watchdog and returns from main has no watchdog thread left when its
// static state is destroyed (the detached thread was still beating: exit status 3). It runs in a
// forked child, which starts the watchdog afresh when this process has not started it (each test
// runs in its own process under ctest).
TEST(CollectiveWatchdogThreads, TheHeartbeatThreadEndsBeforeStaticStateIsDestroyed) {
    const std::string dir = fresh_dir("exit");
    const pid_t child = ::fork();
    if (child == 0) {
        threads_before_watchdog = threads_in_this_process();
        std::atexit(exit_with_thread_count);
        CollectiveWatchdog::instance().configure(600.0, dir, 0, 1);
        std::this_thread::sleep_for(std::chrono::milliseconds(700));  // a beat or two
        std::exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status)) << "the child died of a signal";
    EXPECT_EQ(WEXITSTATUS(status), 0) << "a watchdog thread outlived main";
    // It beat where it was told to, and only there.
    std::ifstream beat(fs::path(dir) / ".heartbeat" / "rank0");
    long pid = 0, seq = -1;
    std::string op;
    beat >> pid >> seq >> op;
    EXPECT_EQ(pid, long(child));
    EXPECT_EQ(op, "-");
}

// Ranks run as threads of one process: they open collectives while another reconfigures the
// watchdog (new directory, new rank) and the heartbeat thread reads both. ThreadSanitizer fails
// the test on any unsynchronised access; the counts check that every collective was seen.
TEST(CollectiveWatchdogThreads, CollectivesAndReconfigurationFromManyThreads) {
    const std::string dir = fresh_dir("threads");
    CollectiveWatchdog::instance().configure(600.0, dir + "/a", 0, 4);
    constexpr int kThreads = 4, kScopes = 2000;
    std::atomic<bool> go{false};
    std::vector<std::thread> ranks;
    for (int t = 0; t < kThreads; ++t)
        ranks.emplace_back([&] {
            while (!go.load()) std::this_thread::yield();
            for (int i = 0; i < kScopes; ++i) {
                CollectiveWatchdog::Scope outer("allreduce");
                CollectiveWatchdog::Scope inner("nested");  // part of the outer one
            }
        });
    std::thread reconfigure([&] {
        while (!go.load()) std::this_thread::yield();
        for (int i = 0; i < 50; ++i)
            CollectiveWatchdog::instance().configure(600.0, dir + (i % 2 ? "/a" : "/b"), i % 4, 4);
    });
    go.store(true);
    for (std::thread& r : ranks) r.join();
    reconfigure.join();
    CollectiveWatchdog::instance().configure(600.0, dir + "/a", 1, 4);
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // the thread beats again
    std::ifstream beat(fs::path(dir) / "a" / ".heartbeat" / "rank1");
    long pid = 0, seq = -1;
    std::string op;
    beat >> pid >> seq >> op;
    EXPECT_EQ(pid, long(::getpid()));
    // Nested scopes count once; the outer ones of all threads count, however they interleave.
    EXPECT_EQ(seq, long(kThreads) * kScopes);
    EXPECT_EQ(op, "-");
}
