// The CPU thread pool: parallel_for covers every index once, and calls from several threads at
// once (ranks as threads of one process, as the GPU tests run trainers) each get their own job
// done: one claims the pool, the others run serially on their caller.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "sparsetron/core/thread_pool.h"

using namespace sparsetron;

TEST(ThreadPool, EveryIndexOnceInContiguousChunks) {
    const int64_t n = 10007;
    std::vector<int> hits(n, 0);
    parallel_for(n, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)], 1) << "index " << i;
}

// Four threads call parallel_for 2000 times each (on a pool of 8), at once, each writing its own
// array with its own values: every thread must find exactly its values in every index after every
// call (a pool taken by two callers at once ran one caller's function over the other's range, or
// lost a part).
TEST(ThreadPool, ConcurrentCallersEachGetTheirOwnJob) {
    const int before = num_threads();
    set_num_threads(8);
    const int callers = 4, rounds = 2000;
    const int64_t n = 1024;
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int c = 0; c < callers; ++c)
        threads.emplace_back([&, c] {
            std::vector<int64_t> out(n, -1);
            for (int r = 0; r < rounds; ++r) {
                const int64_t tag = int64_t(c) * 1000000 + r * 1000;
                parallel_for(
                    n,
                    [&](int64_t b, int64_t e) {
                        for (int64_t i = b; i < e; ++i) out[size_t(i)] = tag + i % 1000;
                    },
                    16);
                for (int64_t i = 0; i < n; ++i)
                    if (out[size_t(i)] != tag + i % 1000) {
                        ++wrong;
                        break;
                    }
            }
        });
    for (auto& t : threads) t.join();
    set_num_threads(before);
    EXPECT_EQ(wrong.load(), 0) << "rounds where a caller's array did not hold its own values";
}
