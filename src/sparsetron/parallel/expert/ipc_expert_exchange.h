// The expert exchange over CUDA IPC (expert_exchange.h): kernels read peer GPU memory over
// NVLink, so every rank of the expert-parallel group must be on one node with peer access.
// Each rank allocates one shared region (the most rows it publishes, plus its offsets and two
// flags) that every peer maps once. An exchange: begin_send() waits until every peer finished
// reading this rank's previous publication and hands out the region, where the caller's kernels
// write the rows; the exchange call publishes them (a flag with the exchange's epoch), pulls
// from every peer's region once its flag shows the epoch, and says so. A peer that does not
// publish within a minute makes the kernel trap (the process fails, the launcher takes the job
// down): no silent hang.
#pragma once

#include <vector>

#include "sparsetron/parallel/expert/expert_exchange.h"

namespace sparsetron::cuda {

class IpcExpertExchange final : public ExpertExchange {
  public:
    // Collective over `ep` (all its ranks on this node, one GPU each): maps every rank's region.
    IpcExpertExchange(Comm& ep, const ExchangeShape& shape);
    ~IpcExpertExchange() override;

    ExchangeTransport transport() const override { return ExchangeTransport::Nvlink; }
    int64_t device_bytes() const override { return region_bytes_; }
    static int64_t region_bytes_for(const ExchangeShape& shape);

    bf16* begin_send(const ExecContext& ctx) override;
    void dispatch(const ExecContext& ctx, const int32_t* offsets, int32_t* all_offsets,
                  int32_t* recv_offsets, bf16* y) override;
    void dispatch_again(const ExecContext& ctx, const int32_t* all_offsets, bf16* y) override;
    void combine(const ExecContext& ctx, const int32_t* all_offsets, bf16* x) override;

  private:
    void publish(const ExecContext& ctx, const int32_t* offsets);
    template <bool Dispatch>
    void pull(const ExecContext& ctx, const int32_t* all_offsets, bf16* out);
    void wait_published(const ExecContext& ctx);
    void finish(const ExecContext& ctx);
    int64_t region_bytes_ = 0;
    void* region_ = nullptr;     // this rank's shared region (cudaMalloc)
    void** peers_ = nullptr;     // device [W]: every rank's region, mapped here (self included)
    std::vector<void*> opened_;  // peers' regions opened through IPC
    uint32_t* epoch_ = nullptr;  // device: exchanges so far
};

}  // namespace sparsetron::cuda
