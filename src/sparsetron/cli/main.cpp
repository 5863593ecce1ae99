// `sparsetron`: the command line. Each subcommand lives in a file of its own (command.h); main
// builds the app, runs the parsed subcommand, and turns errors into messages and exit codes.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <utility>
#include <vector>

#include "command.h"
#include "sparsetron/parallel/comm/launch_env.h"
#if SPARSETRON_MPI
#include "sparsetron/parallel/comm/mpi/mpi_comm.h"
#endif

using namespace sparsetron;

int main(int argc, char** argv) {
#if SPARSETRON_MPI
    // Under mpirun (or another launcher) this binary is one rank of a data-parallel job.
    std::unique_ptr<MpiComm> mpi;
    try {
        if (detect_launch_env().world > 1) {
            mpi = std::make_unique<MpiComm>(&argc, &argv);
            cli::set_launch_comm(mpi.get());
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
#endif
    CLI::App app{
        "Sparsetron: a C++20/CUDA training engine for GLM-5-family sparse-attention MoE "
        "models.\nRun `sparsetron train` to train the built-in tiny recipe on the bundled "
        "corpus.",
        "sparsetron"};
    app.require_subcommand(1);
    app.set_version_flag("--version", SPARSETRON_VERSION);
    std::vector<std::pair<std::string, cli::Run>> commands;
    for (auto add : {cli::add_train, cli::add_eval, cli::add_plan, cli::add_preprocess,
                     cli::add_keys, cli::add_info, cli::add_flops, cli::add_report,
                     cli::add_convert, cli::add_bench, cli::add_bench_exchange, cli::add_stop}) {
        cli::Run run = add(app);
        commands.emplace_back(app.get_subcommands({}).back()->get_name(), std::move(run));
    }
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    }
    try {
        for (auto& [name, run] : commands)
            if (app.got_subcommand(name)) return run();
    } catch (const std::exception& e) {
        std::fflush(stdout);
        Comm* comm = cli::launch_comm();
        if (comm && comm->size() > 1) {
            // One failing rank takes the job down: no rank is left waiting in a collective.
            std::fprintf(stderr, "\nerror (rank %d of %d): %s\n", comm->rank(), comm->size(),
                         e.what());
            std::fflush(stderr);
            comm->abort(1);
        }
        std::fprintf(stderr, "\nerror: %s\n", e.what());
        return 1;
    }
    return 0;
}
