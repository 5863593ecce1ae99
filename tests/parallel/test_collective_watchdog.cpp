// The collective deadline (distributed_timeout_minutes) on MPI ranks (label mpi; runs outside
// mpirun and launches its own jobs): a rank stopped with SIGSTOP used to leave the others
// spinning in their collective forever; now they stop the job within the deadline and name it.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "sparsetron/parallel/comm/collective_watchdog.h"
#include "test_util.h"

namespace fs = std::filesystem;
using sparsetron::CollectiveWatchdog;
using sparsetron::test::line_count;
using sparsetron::test::read_text;

namespace {

void write_heartbeat(const std::string& dir, int rank, const std::string& text,
                     std::chrono::seconds age) {
    const fs::path path = fs::path(dir) / ".heartbeat" / ("rank" + std::to_string(rank));
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text << "\n";
    fs::last_write_time(path, fs::file_time_type::clock::now() - age);
}

}  // namespace

// The message names the rank whose heartbeat went silent and the one that runs outside every
// collective, and leaves out the ranks that wait like this one.
TEST(CollectiveWatchdog, MessageNamesTheRanksThatStoppedAnswering) {
    const std::string dir = sparsetron::test::temp_dir("beats");
    write_heartbeat(dir, 1, "111 40 allreduce", std::chrono::seconds(0));
    write_heartbeat(dir, 2, "222 37 -", std::chrono::seconds(30));
    write_heartbeat(dir, 3, "333 38 -", std::chrono::seconds(0));
    const std::string msg =
        CollectiveWatchdog::timeout_message(0, "allreduce", 40, 61.0, 60.0, dir, 5);
    EXPECT_NE(msg.find("rank 0 waited 61 s in allreduce (collective #40)"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("rank 2 (PID 222: silent for"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 3 (PID 333: running, but in no collective since #38)"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("rank 4 (no heartbeat)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("rank 1 "), std::string::npos) << "rank 1 waits too: " << msg;

    const std::string blind = CollectiveWatchdog::timeout_message(0, "alltoallv", 3, 5, 4, "", 2);
    EXPECT_NE(blind.find("another rank did not arrive"), std::string::npos) << blind;
}

// Three ranks train; rank 2 is stopped (SIGSTOP) mid-run. Ranks 0 and 1 wait in a collective
// past the 3-second deadline, say that rank 2 (its PID) stopped answering, and the job ends
// with a non-zero status (it hung at 100% CPU; the test gives up after 120 s).
TEST(CollectiveWatchdog, AStoppedRankEndsTheJobNamingIt) {
    const std::string out = sparsetron::test::temp_dir("stopped-rank");
    const std::string log = out + ".log";
    const std::string cmd =
        std::string(SPARSETRON_MPIEXEC) +
        " -np 3 --oversubscribe --allow-run-as-root " SPARSETRON_CLI_MPI
        " train -q --no-save --set world_size=3 --set global_batch_size=3 --set train_iters=100000"
        " --set distributed_timeout_minutes=0.05" +
        sparsetron::test::small_model_cli() + " --out " + out + " >" + log + " 2>&1";
    const pid_t launcher = ::fork();
    if (launcher == 0) {
        ::setpgid(0, 0);  // its own process group: the test can end the whole job
        ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
        ::_exit(127);
    }
    const std::string beat = out + "/.heartbeat/rank2";
    for (int i = 0; i < 12000 && (line_count(out + "/metrics.jsonl") < 3 || !fs::exists(beat)); ++i)
        ::usleep(10000);
    ASSERT_GE(line_count(out + "/metrics.jsonl"), 3) << read_text(log);
    pid_t rank2 = 0;
    std::ifstream(beat) >> rank2;
    ASSERT_GT(rank2, 0) << read_text(beat);
    ASSERT_EQ(::kill(rank2, SIGSTOP), 0);

    const auto start = std::chrono::steady_clock::now();
    int status = 0;
    pid_t done = 0;
    while ((done = ::waitpid(launcher, &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() - start < std::chrono::seconds(120))
        ::usleep(50000);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (done == 0) {  // hung: clean up so the test ends
        ::kill(-launcher, SIGKILL);
        ::kill(rank2, SIGKILL);
        ::waitpid(launcher, &status, 0);
    }
    ::kill(rank2, SIGCONT);
    const std::string text = read_text(log);
    ASSERT_NE(done, 0) << "the job still ran 120 s after rank 2 stopped:\n" << text;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << text;
    EXPECT_LT(took, 60.0) << text;
    EXPECT_NE(text.find("rank 2 (PID " + std::to_string(rank2) + ": silent for"), std::string::npos)
        << text;
    EXPECT_NE(text.find("stopped answering; the job stops"), std::string::npos) << text;
}
