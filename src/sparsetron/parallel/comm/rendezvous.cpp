#include "sparsetron/parallel/comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

// Closes the descriptor on every path out.
struct Fd {
    int fd = -1;
    explicit Fd(int f) : fd(f) {}
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
};

void send_all(int fd, const void* data, size_t n, const std::string& what) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
        const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
        ST_CHECK(k > 0, "rendezvous: sending ", what, " failed: ", std::strerror(errno));
        p += k, n -= size_t(k);
    }
}

void recv_all(int fd, void* data, size_t n, const std::string& what) {
    char* p = static_cast<char*>(data);
    while (n > 0) {
        const ssize_t k = ::recv(fd, p, n, 0);
        ST_CHECK(k > 0, "rendezvous: receiving ", what,
                 " failed: ", k == 0 ? "the peer closed the connection" : std::strerror(errno));
        p += k, n -= size_t(k);
    }
}

std::string serve(const LaunchEnv& env, const RendezvousAddress& at, const std::string& payload,
                  double timeout_s) {
    Fd s(::socket(AF_INET, SOCK_STREAM, 0));
    ST_CHECK(s.fd >= 0, "rendezvous: socket: ", std::strerror(errno));
    int one = 1;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(uint16_t(at.port));
    ST_CHECK(::bind(s.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0,
             "rendezvous: rank 0 cannot listen on port ", at.port, ": ", std::strerror(errno),
             " (set MASTER_PORT to a free port)");
    ST_CHECK(::listen(s.fd, 128) == 0, "rendezvous: listen: ", std::strerror(errno));
    timeval tv{};
    tv.tv_sec = long(timeout_s);
    ::setsockopt(s.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    std::vector<bool> seen(size_t(env.world), false);
    const uint64_t n = payload.size();
    for (int got = 1; got < env.world; ++got) {
        Fd c(::accept(s.fd, nullptr, nullptr));
        ST_CHECK(c.fd >= 0, "rendezvous: rank 0 waited ", timeout_s, " s on port ", at.port,
                 " and ", env.world - got, " of ", env.world - 1,
                 " ranks did not connect: ", std::strerror(errno));
        ::setsockopt(c.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        int32_t rank = -1;
        recv_all(c.fd, &rank, sizeof rank, "a rank number");
        ST_CHECK(rank > 0 && rank < env.world && !seen[size_t(rank)], "rendezvous: rank ", rank,
                 " connected, but the job has ranks 1..", env.world - 1, " and each connects once");
        seen[size_t(rank)] = true;
        send_all(c.fd, &n, sizeof n, "the payload size");
        send_all(c.fd, payload.data(), payload.size(), "the payload");
    }
    return payload;
}

std::string join(const LaunchEnv& env, const RendezvousAddress& at, double timeout_s) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    const int rc = ::getaddrinfo(at.host.c_str(), std::to_string(at.port).c_str(), &hints, &res);
    ST_CHECK(rc == 0 && res, "rendezvous: cannot resolve MASTER_ADDR '", at.host,
             "': ", ::gai_strerror(rc));
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000));
    int err = 0;
    for (;;) {
        Fd c(::socket(AF_INET, SOCK_STREAM, 0));
        ST_CHECK(c.fd >= 0, "rendezvous: socket: ", std::strerror(errno));
        if (::connect(c.fd, res->ai_addr, res->ai_addrlen) == 0) {
            ::freeaddrinfo(res);
            timeval tv{};
            tv.tv_sec = long(timeout_s);
            ::setsockopt(c.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
            const int32_t rank = env.rank;
            send_all(c.fd, &rank, sizeof rank, "this rank's number");
            uint64_t n = 0;
            recv_all(c.fd, &n, sizeof n, "the payload size");
            std::string out(n, '\0');
            recv_all(c.fd, out.data(), n, "the payload");
            return out;
        }
        err = errno;
        if (std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::freeaddrinfo(res);
    throw Error(cat("rendezvous: rank ", env.rank, " could not reach rank 0 at ", at.host, ":",
                    at.port, " within ", timeout_s, " s: ", std::strerror(err),
                    " (is rank 0 running? set MASTER_ADDR / MASTER_PORT)"));
}

}  // namespace

RendezvousAddress rendezvous_address() {
    RendezvousAddress a;
    if (const auto h = env_value("MASTER_ADDR")) a.host = *h;
    if (const auto p = env_value("MASTER_PORT")) {
        try {
            a.port = std::stoi(*p);
        } catch (const std::exception&) {
            throw Error(cat("MASTER_PORT='", *p, "' is not a port number"));
        }
        ST_CHECK(a.port > 0 && a.port < 65536, "MASTER_PORT=", a.port, " is not a port number");
    }
    return a;
}

std::string rendezvous_broadcast(const LaunchEnv& env, const RendezvousAddress& at,
                                 const std::string& payload, double timeout_s) {
    if (env.world <= 1) return payload;
    return env.rank == 0 ? serve(env, at, payload, timeout_s) : join(env, at, timeout_s);
}

}  // namespace sparsetron
