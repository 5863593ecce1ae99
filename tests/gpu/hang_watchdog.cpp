// A test of test_gpu that runs far past any test's time (a rank waiting for a collective that
// never comes, a host thread waiting for a kernel that waits for a peer) prints where every
// thread of the process stands and aborts: the GPU machine has no debugger, and a silent hang
// would hold the device until the caller's own time limit.
#include <dirent.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace {

// Several times the longest test of the suite.
constexpr std::chrono::seconds kLimit{150};

std::atomic<bool> g_writing{false};

// SIGUSR2: this thread's stack to stderr, one thread at a time.
void print_stack(int) {
    void* frames[48];
    const int n = backtrace(frames, 48);
    while (g_writing.exchange(true)) {
    }
    char head[48];
    const int len = std::snprintf(head, sizeof head, "--- thread %ld\n", long(syscall(SYS_gettid)));
    if (write(2, head, size_t(len)) < 0) {
    }
    backtrace_symbols_fd(frames, n, 2);
    g_writing.store(false);
}

// The watcher's state lives as long as the process (never freed: the watcher thread outlives
// the listener, which gtest deletes at exit).
struct Watch {
    std::mutex mu;
    std::condition_variable cv;
    std::string test;
    std::chrono::steady_clock::time_point deadline;
    bool armed = false;
};

[[noreturn]] void dump_and_abort(const std::string& test) {
    std::fprintf(stderr, "\n%s ran past %lld s: every thread's stack, then abort\n", test.c_str(),
                 static_cast<long long>(kLimit.count()));
    const long self = syscall(SYS_gettid);
    if (DIR* d = opendir("/proc/self/task")) {
        while (const dirent* e = readdir(d)) {
            const long tid = std::atol(e->d_name);
            if (tid <= 0 || tid == self) continue;
            syscall(SYS_tgkill, long(getpid()), tid, SIGUSR2);
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        closedir(d);
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
    std::abort();
}

void watch(Watch& w) {
    std::unique_lock<std::mutex> lock(w.mu);
    for (;;) {
        if (!w.armed) {
            w.cv.wait(lock);
            continue;
        }
        const auto deadline = w.deadline;
        w.cv.wait_until(lock, deadline);
        if (w.armed && w.deadline == deadline && std::chrono::steady_clock::now() >= deadline)
            dump_and_abort(w.test);
    }
}

class HangWatchdog final : public testing::EmptyTestEventListener {
  public:
    HangWatchdog() : w_(*new Watch) {
        struct sigaction sa {};
        sa.sa_handler = print_stack;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESTART;
        sigaction(SIGUSR2, &sa, nullptr);
        void* first[1];
        backtrace(first, 1);  // loads the unwinder now, not inside a signal handler
        std::thread(watch, std::ref(w_)).detach();
    }
    void OnTestStart(const testing::TestInfo& t) override {
        std::lock_guard<std::mutex> lock(w_.mu);
        w_.test = std::string(t.test_suite_name()) + "." + t.name();
        w_.deadline = std::chrono::steady_clock::now() + kLimit;
        w_.armed = true;
        w_.cv.notify_all();
    }
    void OnTestEnd(const testing::TestInfo&) override {
        std::lock_guard<std::mutex> lock(w_.mu);
        w_.armed = false;
        w_.cv.notify_all();
    }

  private:
    Watch& w_;
};

const bool kRegistered = [] {
    testing::UnitTest::GetInstance()->listeners().Append(new HangWatchdog);
    return true;
}();

}  // namespace
