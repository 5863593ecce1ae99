// Stopping an MPI job gracefully (label mpi; launches its own jobs): `sparsetron stop OUT`
// signals the ranks themselves, and a signal to mpirun reaches them within its kill sequence
// (SIGTERM after odls_base_sigkill_timeout seconds, SIGKILL as long after). Either way every
// rank finishes the step, the checkpoint of that step is complete, and the ranks exit 128 + the
// signal.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "test_util.h"

namespace fs = std::filesystem;
using sparsetron::test::line_count;
using sparsetron::test::read_text;

namespace {

// A two-rank job of the small model with steps long enough to be signalled mid-step.
struct Job {
    pid_t launcher = 0;
    std::string out, log;
};

Job start_job(const std::string& out, const std::string& mpirun_options) {
    Job job{0, out, out + ".log"};
    const std::string cmd =
        std::string(SPARSETRON_MPIEXEC) + " " + mpirun_options +
        " -np 2 --oversubscribe --allow-run-as-root " SPARSETRON_CLI_MPI
        " train -q --set world_size=2 --set global_batch_size=2 --set train_iters=100000" +
        sparsetron::test::small_model_cli() + " --set seq_length=512 --out " + out + " >" +
        job.log + " 2>&1";
    job.launcher = ::fork();
    if (job.launcher == 0) {
        ::setpgid(0, 0);  // its own process group: the test can end the whole job
        ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
        ::_exit(127);
    }
    for (int i = 0; i < 12000 && line_count(out + "/metrics.jsonl") < 2; ++i) ::usleep(10000);
    return job;
}

// The launcher's exit status, or -1 when it still ran after `limit` (the job is then killed).
int wait_job(const Job& job, std::chrono::seconds limit) {
    const auto start = std::chrono::steady_clock::now();
    int status = 0;
    pid_t done = 0;
    while ((done = ::waitpid(job.launcher, &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() - start < limit)
        ::usleep(50000);
    if (done == 0) {
        ::kill(-job.launcher, SIGKILL);
        ::waitpid(job.launcher, &status, 0);
        return -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The checkpoint of the last step in metrics.jsonl is complete (its model file and the pointer
// to it), so a resume continues exactly there.
void expect_checkpoint_of_last_step(const std::string& out, const std::string& log) {
    const int steps = line_count(out + "/metrics.jsonl");
    char name[32];
    std::snprintf(name, sizeof name, "iter_%07d", steps);
    EXPECT_TRUE(fs::exists(out + "/checkpoints/" + name + "/model.safetensors")) << name << log;
    EXPECT_EQ(read_text(out + "/checkpoints/latest_checkpointed_iteration.txt"),
              std::to_string(steps) + "\n")
        << log;
    EXPECT_NE(log.find("stopped after step " + std::to_string(steps)), std::string::npos) << log;
}

}  // namespace

// `sparsetron stop --interrupt OUT` on a running two-rank job: the ranks save the step and exit
// 130, and so does mpirun (which exits 1 when it is signalled itself).
TEST(MpiSignals, StopSignalsTheRanksWhichSaveAndExit) {
    const Job job = start_job(sparsetron::test::temp_dir("stop"), "");
    ASSERT_GE(line_count(job.out + "/metrics.jsonl"), 2) << read_text(job.log);
    const sparsetron::test::CliRun stop = sparsetron::test::run_cli("stop --interrupt " + job.out);
    EXPECT_EQ(stop.code, 0) << stop.output;
    EXPECT_NE(stop.output.find("sent SIGINT to rank 0 (PID"), std::string::npos) << stop.output;
    EXPECT_NE(stop.output.find("rank 1 (PID"), std::string::npos) << stop.output;
    const int code = wait_job(job, std::chrono::seconds(120));
    const std::string log = read_text(job.log);
    EXPECT_EQ(code, 130) << log;
    expect_checkpoint_of_last_step(job.out, log);
    // The run has ended: a second stop names no process instead of signalling a stranger.
    const sparsetron::test::CliRun again = sparsetron::test::run_cli("stop " + job.out);
    EXPECT_EQ(again.code, 1) << again.output;
    EXPECT_NE(again.output.find("it has ended"), std::string::npos) << again.output;
}

// SIGTERM to mpirun, launched with a kill sequence long enough for a step and a save: the ranks
// receive SIGTERM from mpirun, finish the step, save it and exit before its SIGKILL.
TEST(MpiSignals, ATermToMpirunReachesTheGracefulPath) {
    const Job job =
        start_job(sparsetron::test::temp_dir("mpirun-term"), "--mca odls_base_sigkill_timeout 3");
    ASSERT_GE(line_count(job.out + "/metrics.jsonl"), 2) << read_text(job.log);
    ASSERT_EQ(::kill(job.launcher, SIGTERM), 0);
    const int code = wait_job(job, std::chrono::seconds(120));
    const std::string log = read_text(job.log);
    EXPECT_NE(code, -1) << "the job did not end:\n" << log;
    EXPECT_NE(code, 0) << log;
    EXPECT_NE(log.find("stop requested (SIGTERM)"), std::string::npos) << log;
    expect_checkpoint_of_last_step(job.out, log);
}
