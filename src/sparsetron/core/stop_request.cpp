#include "sparsetron/core/stop_request.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

namespace sparsetron {
namespace {

std::atomic<int> g_request{0};

// Async-signal-safe: only write(2) of a fixed text.
void say(const char* text) {
    (void)!::write(2, text, std::strlen(text));
}

void on_signal(int signal) {
    if (signal == SIGPIPE) {
        // Every later write to the closed pipe would raise it again: ignore it from now on
        // (writes then fail with EPIPE), and never let it end the process at once.
        struct sigaction ignore {};
        ignore.sa_handler = SIG_IGN;
        sigemptyset(&ignore.sa_mask);
        sigaction(SIGPIPE, &ignore, nullptr);
        int none = 0;
        if (!g_request.compare_exchange_strong(none, signal)) return;
        say("\nsparsetron: stop requested (SIGPIPE: the reader of the output went away): "
            "finishing this step and saving a checkpoint\n");
        return;
    }
    // A second signal: the user does not want to wait for the step and the save.
    if (g_request.load() != 0 && g_request.load() != SIGPIPE) ::_exit(128 + signal);
    g_request.store(signal);
    say(signal == SIGHUP ? "\nsparsetron: stop requested (SIGHUP): finishing this step and saving "
                           "a checkpoint (signal again to exit at once)\n"
        : signal == SIGINT
            ? "\nsparsetron: stop requested (SIGINT): finishing this step and saving a "
              "checkpoint (signal again to exit at once)\n"
            : "\nsparsetron: stop requested (SIGTERM): finishing this step and saving a "
              "checkpoint (signal again to exit at once)\n");
}

}  // namespace

void install_stop_request_handlers() {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int signal : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaction(signal, &sa, nullptr);
}

int stop_request() {
    return g_request.load();
}

void set_stop_request(int signal) {
    g_request.store(signal);
}

const char* stop_signal_name(int signal) {
    switch (signal) {
        case SIGINT:
            return "SIGINT";
        case SIGTERM:
            return "SIGTERM";
        case SIGHUP:
            return "SIGHUP";
        case SIGPIPE:
            return "SIGPIPE";
        default:
            return "a signal";
    }
}

}  // namespace sparsetron
