#include "sparsetron/parallel/comm/mpi/mpi_comm.h"

#include <mpi.h>

#include <algorithm>

#include "sparsetron/core/error.h"
#include "sparsetron/parallel/comm/collective_watchdog.h"

namespace sparsetron {
namespace {

void check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw Error(cat("MPI error in ", what, ": ", std::string(msg, size_t(len))));
}

// MPI counts are int: large buffers go in chunks.
constexpr int64_t kChunk = int64_t(1) << 30;

// MPI_Comm is an int handle in MPICH and a pointer in OpenMPI: kept in a void* slot either way.
MPI_Comm& handle(void*& slot) {
    static_assert(sizeof(MPI_Comm) <= sizeof(void*), "MPI_Comm must fit a pointer");
    return *reinterpret_cast<MPI_Comm*>(&slot);
}

}  // namespace

MpiComm::MpiComm(int* argc, char*** argv) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) check(MPI_Init(argc, argv), "MPI_Init");
    handle(comm_) = MPI_COMM_WORLD;
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
}

MpiComm::MpiComm(SubComm, void* comm) : comm_(comm), owns_(true) {
    check(MPI_Comm_rank(handle(comm_), &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(handle(comm_), &size_), "MPI_Comm_size");
}

MpiComm::~MpiComm() {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    if (owns_)
        MPI_Comm_free(&handle(comm_));
    else
        MPI_Finalize();  // the world communicator: the process's MPI ends with it
}

void MpiComm::alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                        const std::vector<int64_t>& recv_bytes) {
    ST_CHECK(int(send_bytes.size()) == size_ && int(recv_bytes.size()) == size_,
             "alltoallv: one count per rank");
    CollectiveWatchdog::Scope watched("alltoallv");
    const size_t n = static_cast<size_t>(size_);
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    int64_t so = 0, ro = 0;
    for (int r = 0; r < size_; ++r) {
        // MPI counts and displacements are int: the exchange must stay under 2 GiB per rank.
        ST_CHECK(so + send_bytes[size_t(r)] < kChunk && ro + recv_bytes[size_t(r)] < kChunk,
                 "alltoallv: more than 1 GiB per rank is not supported");
        sc[size_t(r)] = int(send_bytes[size_t(r)]), sd[size_t(r)] = int(so);
        rc[size_t(r)] = int(recv_bytes[size_t(r)]), rd[size_t(r)] = int(ro);
        so += send_bytes[size_t(r)], ro += recv_bytes[size_t(r)];
    }
    check(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE,
                        handle(comm_)),
          "MPI_Alltoallv");
}

std::unique_ptr<Comm> MpiComm::split(int color, int key) {
    CollectiveWatchdog::Scope watched("split");
    void* slot = nullptr;
    check(MPI_Comm_split(handle(comm_), color, key, &handle(slot)), "MPI_Comm_split");
    return std::unique_ptr<Comm>(new MpiComm(SubComm{}, slot));
}

void MpiComm::allreduce_sum(float* x, int64_t n) {
    CollectiveWatchdog::Scope watched("allreduce");
    for (int64_t at = 0; at < n; at += kChunk)
        check(MPI_Allreduce(MPI_IN_PLACE, x + at, int(std::min(kChunk, n - at)), MPI_FLOAT, MPI_SUM,
                            handle(comm_)),
              "MPI_Allreduce");
}

void MpiComm::allreduce_sum(double* x, int64_t n) {
    CollectiveWatchdog::Scope watched("allreduce");
    for (int64_t at = 0; at < n; at += kChunk)
        check(MPI_Allreduce(MPI_IN_PLACE, x + at, int(std::min(kChunk, n - at)), MPI_DOUBLE,
                            MPI_SUM, handle(comm_)),
              "MPI_Allreduce");
}

void MpiComm::broadcast(void* data, int64_t bytes, int root) {
    CollectiveWatchdog::Scope watched("broadcast");
    char* p = static_cast<char*>(data);
    for (int64_t at = 0; at < bytes; at += kChunk)
        check(MPI_Bcast(p + at, int(std::min(kChunk, bytes - at)), MPI_BYTE, root, handle(comm_)),
              "MPI_Bcast");
}

std::vector<uint64_t> MpiComm::allgather(uint64_t value) {
    CollectiveWatchdog::Scope watched("allgather");
    std::vector<uint64_t> all(size_t(size_), 0);
    check(MPI_Allgather(&value, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, handle(comm_)),
          "MPI_Allgather");
    return all;
}

void MpiComm::sendrecv(const void* send, int64_t send_bytes, int dst, void* recv,
                       int64_t recv_bytes, int src) {
    CollectiveWatchdog::Scope watched("pipeline send/recv");
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    if (dst < 0) send_bytes = 0;
    if (src < 0) recv_bytes = 0;
    // In chunks of at most kChunk bytes each way (MPI counts are int); both sides cut alike.
    for (int64_t at = 0; at < std::max(send_bytes, recv_bytes); at += kChunk) {
        const int ns = int(std::clamp<int64_t>(send_bytes - at, 0, kChunk));
        const int nr = int(std::clamp<int64_t>(recv_bytes - at, 0, kChunk));
        if (ns > 0 && nr > 0)
            check(MPI_Sendrecv(s + at, ns, MPI_BYTE, dst, 0, r + at, nr, MPI_BYTE, src, 0,
                               handle(comm_), MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
        else if (ns > 0)
            check(MPI_Send(s + at, ns, MPI_BYTE, dst, 0, handle(comm_)), "MPI_Send");
        else if (nr > 0)
            check(MPI_Recv(r + at, nr, MPI_BYTE, src, 0, handle(comm_), MPI_STATUS_IGNORE),
                  "MPI_Recv");
    }
}

void MpiComm::abort(int code) {
    MPI_Abort(MPI_COMM_WORLD, code);  // the whole job, whichever communicator failed
    std::exit(code);
}

}  // namespace sparsetron
