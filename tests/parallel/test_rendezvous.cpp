// The TCP rendezvous that hands NCCL's unique id from rank 0 to the other ranks: ranks as threads
// of this process on a loopback port.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "sparsetron/core/error.h"
#include "sparsetron/parallel/comm/rendezvous.h"

using namespace sparsetron;

namespace {

// A port per test run: tests of different build trees may run at once on one machine.
int test_port(int offset) {
    return 20000 + int(::getpid() % 20000) + offset;
}

}  // namespace

TEST(Rendezvous, RankZeroHandsTheSameBytesToEveryRank) {
    const int world = 4;
    const RendezvousAddress at{"127.0.0.1", test_port(0)};
    std::string payload(128, '\0');
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = char(i * 37 + 11);  // NUL bytes too
    std::vector<std::string> got(world);
    std::vector<std::thread> ranks;
    std::atomic<int> errors{0};
    for (int r = world - 1; r >= 0; --r)  // clients first: they must wait for the listener
        ranks.emplace_back([&, r] {
            LaunchEnv env;
            env.rank = r, env.world = world, env.local_rank = r;
            try {
                got[size_t(r)] = rendezvous_broadcast(env, at, r == 0 ? payload : "", 20);
            } catch (const std::exception& e) {
                ADD_FAILURE() << "rank " << r << ": " << e.what();
                ++errors;
            }
        });
    for (auto& t : ranks) t.join();
    EXPECT_EQ(errors.load(), 0);
    for (int r = 0; r < world; ++r) EXPECT_EQ(got[size_t(r)], payload) << "rank " << r;
}

TEST(Rendezvous, NoRankZeroIsAClearError) {
    LaunchEnv env;
    env.rank = 1, env.world = 2;
    const RendezvousAddress at{"127.0.0.1", test_port(1)};
    try {
        rendezvous_broadcast(env, at, "", 0.3);
        FAIL() << "joined a rendezvous nobody served";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("could not reach rank 0 at 127.0.0.1:"),
                  std::string::npos)
            << e.what();
    }
}

TEST(Rendezvous, AddressFromTheEnvironment) {
    ::setenv("MASTER_ADDR", "10.1.2.3", 1);
    ::setenv("MASTER_PORT", "31337", 1);
    RendezvousAddress a = rendezvous_address();
    EXPECT_EQ(a.host, "10.1.2.3");
    EXPECT_EQ(a.port, 31337);
    ::setenv("MASTER_PORT", "http", 1);
    EXPECT_THROW(rendezvous_address(), Error);
    ::unsetenv("MASTER_ADDR");
    ::unsetenv("MASTER_PORT");
    a = rendezvous_address();
    EXPECT_EQ(a.host, "127.0.0.1");
    EXPECT_EQ(a.port, 29500);
}
