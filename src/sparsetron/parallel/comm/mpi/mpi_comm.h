// The MPI-backed Comm (OpenMPI from Debian): CPU data parallelism under mpirun, in CI.
#pragma once

#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

class MpiComm final : public Comm {
  public:
    // Initializes MPI (once per process) on MPI_COMM_WORLD.
    MpiComm(int* argc, char*** argv);
    ~MpiComm() override;
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    void allreduce_sum(float* x, int64_t n) override;
    void allreduce_sum(double* x, int64_t n) override;
    void broadcast(void* data, int64_t bytes, int root) override;
    std::vector<uint64_t> allgather(uint64_t value) override;
    void alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                   const std::vector<int64_t>& recv_bytes) override;
    std::unique_ptr<Comm> split(int color, int key) override;
    void sendrecv(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                  int src) override;
    [[noreturn]] void abort(int code) override;
    std::string name() const override { return "MPI"; }

  private:
    struct SubComm {};
    MpiComm(SubComm, void* comm);  // takes ownership of a communicator from MPI_Comm_split
    void* comm_ = nullptr;         // MPI_Comm (MPI_COMM_WORLD for the world communicator)
    bool owns_ = false;
    int rank_ = 0, size_ = 1;
};

}  // namespace sparsetron
