// The launcher environment: mpirun, torchrun-style and SLURM variables, and their errors.
#include <gtest/gtest.h>

#include <cstdlib>

#include "sparsetron/core/error.h"
#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/parallel/comm/launch_env.h"
#include "test_util.h"

using namespace sparsetron;

namespace {
const char* kVars[] = {"OMPI_COMM_WORLD_RANK",
                       "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK",
                       "RANK",
                       "WORLD_SIZE",
                       "LOCAL_RANK",
                       "SLURM_PROCID",
                       "SLURM_NTASKS",
                       "SLURM_LOCALID"};
struct CleanEnv {
    CleanEnv() {
        for (const char* v : kVars) unsetenv(v);
    }
    ~CleanEnv() {
        for (const char* v : kVars) unsetenv(v);
    }
};
using test::error_of;
}  // namespace

TEST(LaunchEnv, ReadsEachLauncher) {
    CleanEnv clean;
    EXPECT_EQ(detect_launch_env().world, 1);
    EXPECT_EQ(detect_launch_env().launcher, "none");
    setenv("SLURM_PROCID", "3", 1);
    setenv("SLURM_NTASKS", "8", 1);
    setenv("SLURM_LOCALID", "1", 1);
    LaunchEnv s = detect_launch_env();
    EXPECT_EQ(s.launcher, "slurm");
    EXPECT_EQ(s.rank, 3);
    EXPECT_EQ(s.world, 8);
    EXPECT_EQ(s.local_rank, 1);
    setenv("RANK", "1", 1);  // torchrun wins over SLURM
    setenv("WORLD_SIZE", "2", 1);
    EXPECT_EQ(detect_launch_env().launcher, "torchrun");
    EXPECT_EQ(detect_launch_env().local_rank, 1);  // LOCAL_RANK unset: the rank
    setenv("OMPI_COMM_WORLD_RANK", "0", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    EXPECT_EQ(detect_launch_env().launcher, "mpirun");
    EXPECT_EQ(detect_launch_env().world, 4);
}

TEST(LaunchEnv, InconsistentValuesNameTheVariable) {
    CleanEnv clean;
    setenv("RANK", "2", 1);
    setenv("WORLD_SIZE", "2", 1);
    EXPECT_NE(error_of([] { detect_launch_env(); }).find("RANK=2 is not in [0, WORLD_SIZE=2)"),
              std::string::npos);
    setenv("WORLD_SIZE", "two", 1);
    EXPECT_NE(error_of([] { detect_launch_env(); }).find("WORLD_SIZE='two' is not an integer"),
              std::string::npos);
    unsetenv("WORLD_SIZE");
    EXPECT_NE(error_of([] { detect_launch_env(); }).find("WORLD_SIZE is missing"),
              std::string::npos);
}

TEST(Comm, SingleProcessIsTheIdentity) {
    SingleProcessComm c;
    float x[2] = {1.5f, -2.f};
    c.allreduce_sum(x, 2);
    EXPECT_EQ(x[0], 1.5f);
    EXPECT_EQ(c.allgather(7), std::vector<uint64_t>{7});
    check_same_on_all_ranks(c, "recipe", "recipe");  // one rank: nothing to differ
}
