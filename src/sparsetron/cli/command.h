// The `sparsetron` command line: one file per subcommand. Each add_<name> function adds its
// subcommand and options to the app and returns the function that runs it once parsed; the
// shared pieces (the launch's communicator, device and document parsing) are declared here.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/tensor.h"
#include "sparsetron/optim/muon.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron::cli {

// Runs a parsed subcommand; returns the process exit code.
using Run = std::function<int()>;

Run add_train(CLI::App& app);
Run add_eval(CLI::App& app);
Run add_plan(CLI::App& app);
Run add_preprocess(CLI::App& app);
Run add_keys(CLI::App& app);
Run add_info(CLI::App& app);
Run add_flops(CLI::App& app);
Run add_report(CLI::App& app);
Run add_convert(CLI::App& app);
Run add_bench(CLI::App& app);
Run add_bench_exchange(CLI::App& app);
Run add_stop(CLI::App& app);

// The communicator of a multi-process launch: MPI ranks of sparsetron-mpi (set by main), or NCCL
// once a CUDA command connects the processes a launcher started; null for one process.
Comm* launch_comm();
void set_launch_comm(Comm* comm);
// Under a launcher (mpirun, torchrun, srun) with more than one process, `--device cuda` runs
// connect over NCCL; a CPU run in this binary stays a single process per launch.
void connect_gpus_if_launched(Device device);

// --device: "cpu" (also the default, empty) or "cuda".
Device parse_device(const std::string& d);
// "a,b,c" -> {"a", "b", "c"} (empty items dropped).
std::vector<std::string> split_list(const std::string& text);
// Documents of one step: --doc-lengths, else one seq_length document per sample of the global
// batch (the seed's THD benchmark packing).
std::vector<int64_t> step_documents(const Recipe& r, const std::string& lengths);
// --json [FILE], one meaning for every subcommand: the result as JSON lines, appended to FILE, or
// on standard output (in place of the text report) without one.
struct JsonOutput {
    std::string file;
    CLI::Option* option = nullptr;
    bool wanted() const { return option && option->count() > 0; }
    bool to_stdout() const { return wanted() && file.empty(); }
    void write(const std::string& line) const;  // when wanted
};
void add_json_output(CLI::App* command, JsonOutput& out, const std::string& what);

// The optimizer's Newton-Schulz work, which the audited count (sparsetron flops) leaves out.
void print_newton_schulz(const NewtonSchulzCount& ns, const RunConfig& r);

}  // namespace sparsetron::cli
