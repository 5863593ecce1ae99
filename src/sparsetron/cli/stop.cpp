// `sparsetron stop OUT`: asks the run writing OUT to finish its step, save a checkpoint and exit,
// by sending SIGTERM to its ranks on this host (one rank's request stops every rank after the
// same step). Under mpirun this is the graceful path: mpirun then exits with the ranks' 143,
// while a signal to mpirun itself reaches the ranks a second before its SIGKILL.
#include <signal.h>

#include <cstdio>
#include <string>

#include "command.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/stop_request.h"
#include "sparsetron/io/rank_processes.h"

namespace sparsetron::cli {

Run add_stop(CLI::App& app) {
    struct Options {
        std::string out;
        bool interrupt = false;
    };
    auto o = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand(
        "stop", "Ask a running `train` to finish its step, save a checkpoint and exit");
    cmd->add_option("out", o->out, "The run's output directory (train --out)")->required();
    cmd->add_flag("--interrupt", o->interrupt,
                  "Send SIGINT (exit 130) instead of SIGTERM (exit 143)");
    return [o] {
        const int signal = o->interrupt ? SIGINT : SIGTERM;
        const std::vector<RankProcess> ranks = read_rank_processes(o->out);
        ST_CHECK(!ranks.empty(), "no run has recorded its processes in '", o->out,
                 "/.ranks' (is it a train --out directory?)");
        std::string sent, elsewhere;
        for (const RankProcess& p : ranks) {
            if (!is_live_sparsetron_process(p)) {
                if (p.host != this_host_name())
                    elsewhere +=
                        cat(elsewhere.empty() ? "" : ", ", "rank ", p.rank, " on ", p.host);
                continue;
            }
            ST_CHECK(::kill(pid_t(p.pid), signal) == 0, "cannot signal rank ", p.rank, " (PID ",
                     p.pid, ")");
            sent += cat(sent.empty() ? "" : ", ", "rank ", p.rank, " (PID ", p.pid, ")");
        }
        ST_CHECK(!sent.empty(), "no process of the run writing '", o->out, "' runs on this host",
                 elsewhere.empty() ? std::string(" (it has ended)")
                                   : cat(" (", elsewhere, ": run `sparsetron stop` there)"));
        std::printf(
            "sent %s to %s: the run finishes its step, saves a checkpoint and exits "
            "(stop again to exit at once, without saving)\n",
            stop_signal_name(signal), sent.c_str());
        return 0;
    };
}

}  // namespace sparsetron::cli
