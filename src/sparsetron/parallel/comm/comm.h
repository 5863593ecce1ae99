// Comm: the collectives the engine's parallel logic uses (DESIGN §2 parallel/). The single-process
// implementation is here; the MPI-backed one (CPU runs under mpirun, in CI) is
// parallel/comm/mpi/mpi_comm.h, kept out of the engine library so the GPU machine's binaries do not
// depend on Debian's libmpi; the NCCL one (one GPU per process, make_nccl_comm()) is
// parallel/nccl/nccl_comm.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sparsetron {

class Comm {
  public:
    virtual ~Comm() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    // In place, sum over ranks; every rank gets the result.
    virtual void allreduce_sum(float* x, int64_t n) = 0;
    virtual void allreduce_sum(double* x, int64_t n) = 0;
    virtual void broadcast(void* data, int64_t bytes, int root) = 0;
    // Every rank's value, in rank order.
    virtual std::vector<uint64_t> allgather(uint64_t value) = 0;
    // Personalized all-to-all in bytes: send_bytes[r] bytes from `send` (ranks in order) go to
    // rank r; recv_bytes[r] bytes from rank r land in `recv` (in rank order).
    virtual void alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                           const std::vector<int64_t>& recv_bytes) = 0;
    // A communicator per color over this one's ranks (ordered by key, then rank): every rank
    // calls it (collective). Process groups are made once this way (DP, CP, EP, dynamic CP).
    virtual std::unique_ptr<Comm> split(int color, int key) = 0;
    // Point to point (pipeline parallelism): `send_bytes` from `send` to rank `dst` and
    // `recv_bytes` from rank `src` into `recv`, both at once so that two stages exchanging in
    // opposite directions cannot wait on each other; dst or src -1: that half is skipped.
    // Blocking. The single-process communicator has no peer to talk to and throws.
    virtual void sendrecv(const void* send, int64_t send_bytes, int dst, void* recv,
                          int64_t recv_bytes, int src);
    // Takes the whole job down (no rank is left waiting in a collective).
    [[noreturn]] virtual void abort(int code) = 0;
    virtual std::string name() const = 0;

    // Collectives on device memory, enqueued on `stream` (a cudaStream_t) without a host
    // synchronization, so a captured CUDA graph can hold them: the NCCL communicator has them
    // (on_device() true); the others throw.
    virtual bool on_device() const { return false; }
    virtual void device_allreduce_sum(float* x, int64_t n, void* stream);
    virtual void device_allreduce_sum(int64_t* x, int64_t n, void* stream);
    // `n` bf16 values in place (bf16 gradient buffers; NCCL rounds each step's sum to bf16).
    virtual void device_allreduce_sum_bf16(void* x, int64_t n, void* stream);
    // In place, the maximum over ranks (flags every rank must agree on).
    virtual void device_allreduce_max(int32_t* x, int64_t n, void* stream);
    // `bytes` at `data` from rank `root` to every rank (in place).
    virtual void device_broadcast(void* data, int64_t bytes, int root, void* stream);
    // In place: rank r's `bytes_per_rank` bytes at data + r * bytes_per_rank go to every rank.
    virtual void device_allgather(void* data, int64_t bytes_per_rank, void* stream);
    // `send` holds size() blocks of `n` floats; block r summed over the ranks lands in rank r's
    // `recv` ([n], apart from `send`).
    virtual void device_reduce_scatter_sum(const float* send, float* recv, int64_t n, void* stream);
    // Uniform all-to-all: block r of `send` (bytes_per_rank each) goes to rank r; block s of
    // `recv` is what rank s sent to this rank.
    virtual void device_alltoall(const void* send, void* recv, int64_t bytes_per_rank,
                                 void* stream);
    // Point to point on device memory (pipeline parallelism), sendrecv's rule: both halves in
    // one group, so two stages exchanging in opposite directions cannot wait on each other;
    // dst or src -1 skips that half.
    virtual void device_sendrecv(const void* send, int64_t send_bytes, int dst, void* recv,
                                 int64_t recv_bytes, int src, void* stream);
};

class SingleProcessComm final : public Comm {
  public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    void allreduce_sum(float*, int64_t) override {}
    void allreduce_sum(double*, int64_t) override {}
    void broadcast(void*, int64_t, int) override {}
    std::vector<uint64_t> allgather(uint64_t v) override { return {v}; }
    void alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                   const std::vector<int64_t>& recv_bytes) override;
    std::unique_ptr<Comm> split(int, int) override { return std::make_unique<SingleProcessComm>(); }
    [[noreturn]] void abort(int code) override;
    std::string name() const override { return "single process"; }
};

// The NCCL communicator over every process of the job `env` describes: this process uses GPU
// env.local_rank (modulo the visible GPUs), the unique id travels over the TCP rendezvous
// (parallel/rendezvous.h: MASTER_ADDR / MASTER_PORT, default 127.0.0.1:29500). Throws in a build
// without NCCL or CUDA.
struct LaunchEnv;
std::unique_ptr<Comm> make_nccl_comm(const LaunchEnv& env);

// Every rank checks that all ranks hold the same text (a recipe): throws naming the first rank
// whose hash differs from rank 0's.
void check_same_on_all_ranks(Comm& comm, const std::string& text, const std::string& what);

}  // namespace sparsetron
