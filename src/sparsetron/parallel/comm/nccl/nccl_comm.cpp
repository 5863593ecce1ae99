#include "sparsetron/parallel/comm/nccl/nccl_comm.h"

#if SPARSETRON_WITH_NCCL

#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "sparsetron/core/cuda_check.h"
#include "sparsetron/parallel/comm/collective_watchdog.h"
#include "sparsetron/parallel/comm/rendezvous.h"

#define ST_NCCL_CHECK(call)                                                                   \
    do {                                                                                      \
        ncclResult_t st_nccl_ = (call);                                                       \
        if (st_nccl_ != ncclSuccess)                                                          \
            throw ::sparsetron::Error(::sparsetron::cat(                                      \
                "NCCL error ", ncclGetErrorString(st_nccl_), " (", ncclGetLastError(nullptr), \
                ") in ", #call, " at ", __FILE__, ":", __LINE__));                            \
    } while (0)

namespace sparsetron {
namespace {

constexpr int64_t kStagingBytes = 64 << 20;

ncclComm_t nc(void* c) {
    return static_cast<ncclComm_t>(c);
}
cudaStream_t cs(void* s) {
    return static_cast<cudaStream_t>(s);
}

}  // namespace

NcclComm::NcclComm(const LaunchEnv& env) : rank_(env.rank), size_(env.world) {
    int devices = 0;
    ST_CUDA_CHECK(cudaGetDeviceCount(&devices));
    ST_CHECK(devices > 0, "NCCL: rank ", env.rank, " sees no GPU");
    device_ = env.local_rank % devices;
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id{};
    if (rank_ == 0) ST_NCCL_CHECK(ncclGetUniqueId(&id));
    const std::string got = rendezvous_broadcast(
        env, rendezvous_address(), std::string(reinterpret_cast<const char*>(&id), sizeof id));
    ST_CHECK(got.size() == sizeof id, "NCCL: the unique id from rank 0 has ", got.size(),
             " bytes, expected ", sizeof id);
    std::memcpy(&id, got.data(), sizeof id);
    ncclComm_t c = nullptr;
    ST_NCCL_CHECK(ncclCommInitRank(&c, size_, id, rank_));
    comm_ = c;
    init_staging();
}

NcclComm::NcclComm(Split, void* comm, int device) : comm_(comm), device_(device) {
    ST_NCCL_CHECK(ncclCommUserRank(nc(comm_), &rank_));
    ST_NCCL_CHECK(ncclCommCount(nc(comm_), &size_));
    init_staging();
}

void NcclComm::init_staging() {
    cudaStream_t s = nullptr;
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
    staging_bytes_ = kStagingBytes;
    ST_CUDA_CHECK(cudaMalloc(&staging_, size_t(staging_bytes_)));
}

NcclComm::~NcclComm() {
    if (comm_) ncclCommDestroy(nc(comm_));
    if (staging_) cudaFree(staging_);
    if (stream_) cudaStreamDestroy(cs(stream_));
}

void NcclComm::allreduce_host(void* x, int64_t n, int dtype, int64_t elem_bytes) {
    CollectiveWatchdog::Scope watched("allreduce");
    char* p = static_cast<char*>(x);
    const int64_t chunk = staging_bytes_ / elem_bytes;
    for (int64_t i = 0; i < n; i += chunk) {
        const int64_t m = std::min(chunk, n - i);
        const size_t bytes = size_t(m * elem_bytes);
        ST_CUDA_CHECK(cudaMemcpyAsync(staging_, p + i * elem_bytes, bytes, cudaMemcpyHostToDevice,
                                      cs(stream_)));
        ST_NCCL_CHECK(ncclAllReduce(staging_, staging_, size_t(m), ncclDataType_t(dtype), ncclSum,
                                    nc(comm_), cs(stream_)));
        ST_CUDA_CHECK(cudaMemcpyAsync(p + i * elem_bytes, staging_, bytes, cudaMemcpyDeviceToHost,
                                      cs(stream_)));
        ST_CUDA_CHECK(cudaStreamSynchronize(cs(stream_)));
    }
}

void NcclComm::allreduce_sum(float* x, int64_t n) {
    allreduce_host(x, n, ncclFloat, sizeof(float));
}

void NcclComm::allreduce_sum(double* x, int64_t n) {
    allreduce_host(x, n, ncclDouble, sizeof(double));
}

void NcclComm::broadcast(void* data, int64_t bytes, int root) {
    CollectiveWatchdog::Scope watched("broadcast");
    char* p = static_cast<char*>(data);
    for (int64_t i = 0; i < bytes; i += staging_bytes_) {
        const int64_t m = std::min(staging_bytes_, bytes - i);
        if (rank_ == root)
            ST_CUDA_CHECK(
                cudaMemcpyAsync(staging_, p + i, size_t(m), cudaMemcpyHostToDevice, cs(stream_)));
        ST_NCCL_CHECK(
            ncclBroadcast(staging_, staging_, size_t(m), ncclChar, root, nc(comm_), cs(stream_)));
        ST_CUDA_CHECK(
            cudaMemcpyAsync(p + i, staging_, size_t(m), cudaMemcpyDeviceToHost, cs(stream_)));
        ST_CUDA_CHECK(cudaStreamSynchronize(cs(stream_)));
    }
}

std::vector<uint64_t> NcclComm::allgather(uint64_t value) {
    CollectiveWatchdog::Scope watched("allgather");
    std::vector<uint64_t> out(size_t(size_), 0);
    uint64_t* d = static_cast<uint64_t*>(staging_);
    ST_CUDA_CHECK(
        cudaMemcpyAsync(d + rank_, &value, sizeof value, cudaMemcpyHostToDevice, cs(stream_)));
    ST_NCCL_CHECK(ncclAllGather(d + rank_, d, 1, ncclUint64, nc(comm_), cs(stream_)));
    ST_CUDA_CHECK(cudaMemcpyAsync(out.data(), d, out.size() * sizeof(uint64_t),
                                  cudaMemcpyDeviceToHost, cs(stream_)));
    ST_CUDA_CHECK(cudaStreamSynchronize(cs(stream_)));
    return out;
}

void NcclComm::alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                         const std::vector<int64_t>& recv_bytes) {
    ST_CHECK(int(send_bytes.size()) == size_ && int(recv_bytes.size()) == size_,
             "alltoallv: one count per rank expected");
    CollectiveWatchdog::Scope watched("alltoallv");
    int64_t total_send = 0, total_recv = 0;
    for (int r = 0; r < size_; ++r) total_send += send_bytes[r], total_recv += recv_bytes[r];
    // Host data: device buffers for this call (not in a training step's hot path).
    char *dsend = nullptr, *drecv = nullptr;
    ST_CUDA_CHECK(cudaMalloc(&dsend, size_t(std::max<int64_t>(total_send, 1))));
    ST_CUDA_CHECK(cudaMalloc(&drecv, size_t(std::max<int64_t>(total_recv, 1))));
    ST_CUDA_CHECK(
        cudaMemcpyAsync(dsend, send, size_t(total_send), cudaMemcpyHostToDevice, cs(stream_)));
    ST_NCCL_CHECK(ncclGroupStart());
    int64_t so = 0, ro = 0;
    for (int r = 0; r < size_; ++r) {
        if (send_bytes[r] > 0)
            ST_NCCL_CHECK(
                ncclSend(dsend + so, size_t(send_bytes[r]), ncclChar, r, nc(comm_), cs(stream_)));
        if (recv_bytes[r] > 0)
            ST_NCCL_CHECK(
                ncclRecv(drecv + ro, size_t(recv_bytes[r]), ncclChar, r, nc(comm_), cs(stream_)));
        so += send_bytes[r], ro += recv_bytes[r];
    }
    ST_NCCL_CHECK(ncclGroupEnd());
    ST_CUDA_CHECK(
        cudaMemcpyAsync(recv, drecv, size_t(total_recv), cudaMemcpyDeviceToHost, cs(stream_)));
    ST_CUDA_CHECK(cudaStreamSynchronize(cs(stream_)));
    cudaFree(dsend);
    cudaFree(drecv);
}

std::unique_ptr<Comm> NcclComm::split(int color, int key) {
    CollectiveWatchdog::Scope watched("split");
    ncclComm_t c = nullptr;
    ST_NCCL_CHECK(ncclCommSplit(nc(comm_), color, key, &c, nullptr));
    ST_CHECK(c, "ncclCommSplit gave no communicator for color ", color);
    return std::unique_ptr<Comm>(new NcclComm(Split{}, c, device_));
}

void NcclComm::abort(int code) {
    // Abort the communicator so this rank never waits in a collective; the launcher (mpirun,
    // torchrun, srun) ends the other ranks when this one exits with an error.
    if (comm_) ncclCommAbort(nc(comm_));
    comm_ = nullptr;
    std::_Exit(code);
}

void NcclComm::device_allreduce_sum(float* x, int64_t n, void* stream) {
    if (n == 0) return;
    ST_NCCL_CHECK(ncclAllReduce(x, x, size_t(n), ncclFloat, ncclSum, nc(comm_), cs(stream)));
}

void NcclComm::device_allreduce_sum(int64_t* x, int64_t n, void* stream) {
    if (n == 0) return;
    ST_NCCL_CHECK(ncclAllReduce(x, x, size_t(n), ncclInt64, ncclSum, nc(comm_), cs(stream)));
}

void NcclComm::device_allreduce_sum_bf16(void* x, int64_t n, void* stream) {
    if (n == 0) return;
    ST_NCCL_CHECK(ncclAllReduce(x, x, size_t(n), ncclBfloat16, ncclSum, nc(comm_), cs(stream)));
}

void NcclComm::device_allreduce_max(int32_t* x, int64_t n, void* stream) {
    if (n == 0) return;
    ST_NCCL_CHECK(ncclAllReduce(x, x, size_t(n), ncclInt32, ncclMax, nc(comm_), cs(stream)));
}

void NcclComm::device_broadcast(void* data, int64_t bytes, int root, void* stream) {
    if (bytes == 0) return;
    ST_NCCL_CHECK(ncclBroadcast(data, data, size_t(bytes), ncclUint8, root, nc(comm_), cs(stream)));
}

void NcclComm::device_allgather(void* data, int64_t bytes_per_rank, void* stream) {
    if (bytes_per_rank == 0) return;
    char* base = static_cast<char*>(data);
    ST_NCCL_CHECK(ncclAllGather(base + rank_ * bytes_per_rank, base, size_t(bytes_per_rank),
                                ncclUint8, nc(comm_), cs(stream)));
}

void NcclComm::device_reduce_scatter_sum(const float* send, float* recv, int64_t n, void* stream) {
    if (n == 0) return;
    ST_NCCL_CHECK(
        ncclReduceScatter(send, recv, size_t(n), ncclFloat, ncclSum, nc(comm_), cs(stream)));
}

void NcclComm::device_alltoall(const void* send, void* recv, int64_t bytes_per_rank, void* stream) {
    if (bytes_per_rank == 0) return;
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    ST_NCCL_CHECK(ncclGroupStart());
    for (int peer = 0; peer < size_; ++peer) {
        ST_NCCL_CHECK(ncclSend(s + peer * bytes_per_rank, size_t(bytes_per_rank), ncclUint8, peer,
                               nc(comm_), cs(stream)));
        ST_NCCL_CHECK(ncclRecv(r + peer * bytes_per_rank, size_t(bytes_per_rank), ncclUint8, peer,
                               nc(comm_), cs(stream)));
    }
    ST_NCCL_CHECK(ncclGroupEnd());
}

void NcclComm::device_sendrecv(const void* send, int64_t send_bytes, int dst, void* recv,
                               int64_t recv_bytes, int src, void* stream) {
    const bool out = dst >= 0 && send_bytes > 0, in = src >= 0 && recv_bytes > 0;
    if (!out && !in) return;
    ST_NCCL_CHECK(ncclGroupStart());
    if (out)
        ST_NCCL_CHECK(ncclSend(send, size_t(send_bytes), ncclUint8, dst, nc(comm_), cs(stream)));
    if (in)
        ST_NCCL_CHECK(ncclRecv(recv, size_t(recv_bytes), ncclUint8, src, nc(comm_), cs(stream)));
    ST_NCCL_CHECK(ncclGroupEnd());
}

std::unique_ptr<Comm> make_nccl_comm(const LaunchEnv& env) {
    return std::make_unique<NcclComm>(env);
}

}  // namespace sparsetron

#else  // no NCCL in this build

#include "sparsetron/core/error.h"

namespace sparsetron {

std::unique_ptr<Comm> make_nccl_comm(const LaunchEnv&) {
    throw Error(
        "this build has no NCCL (configure with CUDA and NCCL's nccl.h / libnccl present) "
        "so multi-GPU runs are unavailable; CPU data parallelism runs with sparsetron-mpi");
}

}  // namespace sparsetron

#endif
