// Stopping a run cleanly (Megatron's exit_signal_handler): the first SIGINT, SIGTERM or SIGHUP
// (a closed terminal or session) asks the trainer to finish its current step, save a checkpoint
// and exit with 128 + the signal's number; a second one ends the process at once with the same
// code. SIGPIPE (the reader of the output went away, as in `train ... | head`) asks the same,
// once: later writes to the closed output fail quietly instead of raising it again, and it never
// counts as the second signal. The handler only records the signal; the trainer reads it between
// steps.
#pragma once

namespace sparsetron {

// Installs the handlers for SIGINT, SIGTERM, SIGHUP and SIGPIPE (idempotent).
void install_stop_request_handlers();

// The signal that asked the run to stop, or 0.
int stop_request();

// For tests: as if `signal` had arrived (0 clears the request).
void set_stop_request(int signal);

// The signal's name for messages ("SIGTERM"), or "a signal" for one not handled here.
const char* stop_signal_name(int signal);

}  // namespace sparsetron
