#include "sparsetron/parallel/comm/comm.h"

#include <cstdlib>
#include <cstring>

#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"

namespace sparsetron {

void SingleProcessComm::alltoallv(const void* send, const std::vector<int64_t>& send_bytes,
                                  void* recv, const std::vector<int64_t>& recv_bytes) {
    ST_CHECK(send_bytes.size() == 1 && recv_bytes.size() == 1 && send_bytes[0] == recv_bytes[0],
             "alltoallv on one process: one equal count expected");
    if (send_bytes[0] > 0) std::memmove(recv, send, size_t(send_bytes[0]));
}

void SingleProcessComm::abort(int code) {
    std::exit(code);
}

void Comm::sendrecv(const void*, int64_t, int dst, void*, int64_t, int src) {
    if (dst < 0 && src < 0) return;
    throw Error(cat("the ", name(), " communicator has no point-to-point transfers (MPI has)"));
}

void Comm::device_allreduce_sum(float*, int64_t, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_allreduce_sum(int64_t*, int64_t, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_allreduce_sum_bf16(void*, int64_t, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_allreduce_max(int32_t*, int64_t, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_broadcast(void*, int64_t, int, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_alltoall(const void*, void*, int64_t, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_sendrecv(const void*, int64_t, int, void*, int64_t, int, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_allgather(void*, int64_t, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void Comm::device_reduce_scatter_sum(const float*, float*, int64_t, void*) {
    throw Error(cat("the ", name(), " communicator has no device collectives (NCCL has)"));
}

void check_same_on_all_ranks(Comm& comm, const std::string& text, const std::string& what) {
    const std::vector<uint64_t> hashes = comm.allgather(hash_name(text.c_str()));
    for (size_t r = 1; r < hashes.size(); ++r)
        ST_CHECK(hashes[r] == hashes[0], "rank ", r, " loaded a different ", what, " than rank 0 (",
                 "hash ", hashes[r], " vs ", hashes[0], "); every rank must run the same ", what);
}

}  // namespace sparsetron
