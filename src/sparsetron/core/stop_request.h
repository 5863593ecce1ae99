// Stopping a run cleanly (Megatron's exit_signal_handler): the first SIGINT or SIGTERM asks the
// trainer to finish its current step, save a checkpoint and exit with 128 + the signal's number;
// a second one ends the process at once with the same code. The handler only records the
// signal; the trainer reads it between steps.
#pragma once

namespace sparsetron {

// Installs the handlers for SIGINT and SIGTERM (idempotent).
void install_stop_request_handlers();

// The signal that asked the run to stop, or 0.
int stop_request();

// For tests: as if `signal` had arrived (0 clears the request).
void set_stop_request(int signal);

}  // namespace sparsetron
