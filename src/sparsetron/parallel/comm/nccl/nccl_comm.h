// The NCCL communicator: one GPU per process. Host-memory collectives (loss sums, recipe hashes,
// the EP exchange's counts) go through a device staging buffer on the communicator's own stream
// and synchronize; device-memory collectives (gradients, routing statistics) are enqueued on the
// caller's stream with no synchronization, so the full-iteration CUDA graph captures them.
// Built only with CUDA and NCCL (SPARSETRON_WITH_NCCL); make_nccl_comm() (comm.h) creates one.
#pragma once

#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/parallel/comm/launch_env.h"

namespace sparsetron {

class NcclComm final : public Comm {
  public:
    // The world communicator: selects GPU env.local_rank, takes the unique id from rank 0 over
    // the TCP rendezvous, initializes NCCL.
    explicit NcclComm(const LaunchEnv& env);
    ~NcclComm() override;
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    void allreduce_sum(float* x, int64_t n) override;
    void allreduce_sum(double* x, int64_t n) override;
    void broadcast(void* data, int64_t bytes, int root) override;
    std::vector<uint64_t> allgather(uint64_t value) override;
    void alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                   const std::vector<int64_t>& recv_bytes) override;
    std::unique_ptr<Comm> split(int color, int key) override;
    [[noreturn]] void abort(int code) override;
    std::string name() const override { return "NCCL"; }
    bool on_device() const override { return true; }
    void device_allreduce_sum(float* x, int64_t n, void* stream) override;
    void device_allreduce_sum(int64_t* x, int64_t n, void* stream) override;
    void device_allreduce_sum_bf16(void* x, int64_t n, void* stream) override;
    void device_allreduce_max(int32_t* x, int64_t n, void* stream) override;
    void device_broadcast(void* data, int64_t bytes, int root, void* stream) override;
    void device_allgather(void* data, int64_t bytes_per_rank, void* stream) override;
    void device_reduce_scatter_sum(const float* send, float* recv, int64_t n,
                                   void* stream) override;
    void device_alltoall(const void* send, void* recv, int64_t bytes_per_rank,
                         void* stream) override;
    void device_sendrecv(const void* send, int64_t send_bytes, int dst, void* recv,
                         int64_t recv_bytes, int src, void* stream) override;
    int device() const { return device_; }

  private:
    struct Split {};
    NcclComm(Split, void* comm, int device);  // owns a communicator from ncclCommSplit
    void init_staging();
    // Host data through the staging buffer in chunks: copy in, all-reduce (ncclDataType_t
    // `dtype`), copy out, synchronize.
    void allreduce_host(void* x, int64_t n, int dtype, int64_t elem_bytes);
    void* comm_ = nullptr;    // ncclComm_t
    void* stream_ = nullptr;  // cudaStream_t of the host-memory collectives
    void* staging_ = nullptr;
    int64_t staging_bytes_ = 0;
    int rank_ = 0, size_ = 1, device_ = 0;
};

}  // namespace sparsetron
