// The thread harness itself (gpu/thread_comm.h): host collectives among threads, and a rank that
// fails releasing the others (of every communicator of the job) with an error instead of leaving
// them waiting forever, which would hang the whole GPU suite. Host collectives only: no GPU.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "gpu/harness.h"

#if SPARSETRON_WITH_CUDA
#include "gpu/thread_comm.h"
#endif

using namespace sparsetron;

#if !SPARSETRON_WITH_CUDA
TEST(ThreadComm, Skipped) {
    GTEST_SKIP() << "built without CUDA: the thread harness serves the GPU tests";
}
#else

TEST(ThreadComm, AFailingRankReleasesTheOthers) {
    using test::ThreadComm, test::ThreadGroup;
    auto group = std::make_shared<ThreadGroup>(3);
    std::vector<std::string> errors(3);
    std::vector<double> sums(3, 0.0);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 3; ++rank)
        threads.emplace_back([&, rank] {
            try {
                ThreadComm comm(group, rank);
                double x = rank + 1;
                comm.allreduce_sum(&x, 1);
                sums[size_t(rank)] = x;
                // Ranks 1 and 2 meet in a communicator of their own (a split of the job's).
                auto pair = comm.split(rank == 0 ? 0 : 1, rank);
                if (rank == 0) throw Error("rank 0 fails");
                double y = 1;
                comm.allreduce_sum(&y, 1);  // waits for rank 0, which never comes
                pair->allreduce_sum(&y, 1);
            } catch (const std::exception& e) {
                errors[size_t(rank)] = e.what();
                group->fail();
            }
        });
    for (auto& t : threads) t.join();
    for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(sums[size_t(rank)], 6.0) << "rank " << rank;
    EXPECT_EQ(errors[0], "rank 0 fails");
    for (int rank = 1; rank < 3; ++rank)
        EXPECT_NE(errors[size_t(rank)].find("another rank of the job failed"), std::string::npos)
            << "rank " << rank << ": " << errors[size_t(rank)];
}

#endif  // SPARSETRON_WITH_CUDA
