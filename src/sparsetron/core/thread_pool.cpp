#include "sparsetron/core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "sparsetron/core/env.h"

namespace sparsetron {
namespace {

class Pool {
  public:
    explicit Pool(int n) { resize(n); }
    ~Pool() { stop(); }

    int size() const { return static_cast<int>(workers_.size()) + 1; }

    void resize(int n) {
        stop();
        stopping_ = false;
        // New workers start from the current generation: a finished job must never run again.
        const uint64_t generation = generation_;
        for (int i = 1; i < n; ++i)
            workers_.emplace_back([this, i, generation] { loop(i, generation); });
    }

    void run(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
        int parts = static_cast<int>(std::min<int64_t>(size(), (n + min_chunk - 1) / min_chunk));
        // One job at a time: the caller that claims the pool runs it; nested calls and calls
        // from other threads meanwhile (ranks as threads of one process) run serially on their
        // caller. The claim is one atomic exchange: a check and a later set let two threads
        // both take the pool and overwrite each other's job.
        bool idle = false;
        if (parts <= 1 || !busy_.compare_exchange_strong(idle, true)) {
            if (n > 0) fn(0, n);
            return;
        }
        std::unique_lock<std::mutex> lock(mu_);
        fn_ = &fn;
        n_ = n;
        parts_ = parts;
        pending_ = parts - 1;
        error_ = nullptr;
        ++generation_;
        lock.unlock();
        cv_.notify_all();
        run_part(0);
        lock.lock();
        done_cv_.wait(lock, [this] { return pending_ == 0; });
        const std::exception_ptr error = error_;
        busy_ = false;
        if (error) std::rethrow_exception(error);
    }

  private:
    void run_part(int part) {
        int64_t begin = n_ * part / parts_, end = n_ * (part + 1) / parts_;
        try {
            if (begin < end) (*fn_)(begin, end);
        } catch (...) {
            std::lock_guard<std::mutex> g(mu_);
            if (!error_) error_ = std::current_exception();
        }
    }

    void loop(int index, uint64_t seen) {
        for (;;) {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
            if (stopping_) return;
            seen = generation_;
            bool mine = index < parts_;
            lock.unlock();
            if (!mine) continue;
            run_part(index);
            lock.lock();
            if (--pending_ == 0) done_cv_.notify_one();
        }
    }

    void stop() {
        {
            std::lock_guard<std::mutex> g(mu_);
            stopping_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
        workers_.clear();
    }

    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
    int64_t n_ = 0;
    int parts_ = 0, pending_ = 0;
    uint64_t generation_ = 0;
    bool stopping_ = false;
    std::atomic<bool> busy_{false};
    std::exception_ptr error_;
};

int default_threads() {
    if (const auto env = env_value("SPARSETRON_NUM_THREADS")) {
        const int n = std::atoi(env->c_str());
        if (n > 0) return n;
    }
    return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
    static Pool p(default_threads());
    return p;
}

}  // namespace

int num_threads() {
    return pool().size();
}
void set_num_threads(int n) {
    pool().resize(std::max(1, n));
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
    pool().run(n, fn, std::max<int64_t>(1, min_chunk));
}

}  // namespace sparsetron
