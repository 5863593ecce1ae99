#include "sparsetron/core/stop_request.h"

#include <unistd.h>

#include <atomic>
#include <csignal>

namespace sparsetron {
namespace {

std::atomic<int> g_request{0};

void on_signal(int signal) {
    // A second signal: the user does not want to wait for the step and the save.
    if (g_request.load() != 0) ::_exit(128 + signal);
    g_request.store(signal);
    static const char note[] =
        "\nsparsetron: stop requested: finishing this step and saving a checkpoint "
        "(signal again to exit at once)\n";
    (void)!::write(2, note, sizeof note - 1);
}

}  // namespace

void install_stop_request_handlers() {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
}

int stop_request() {
    return g_request.load();
}

void set_stop_request(int signal) {
    g_request.store(signal);
}

}  // namespace sparsetron
