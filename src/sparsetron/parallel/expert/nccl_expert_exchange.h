// The expert exchange over NCCL (expert_exchange.h), for expert-parallel groups that span nodes
// (Megatron's all-to-all token dispatcher). NCCL's sizes are host values fixed when a CUDA graph
// is captured, so every exchange moves fixed-size blocks: pair_rows rows from each rank to each
// rank, the most one source can send one owner under the routing rules (dropless: all its
// routed rows; with a capacity or force-balanced routing: the owner's experts' capacities, about
// a W-th of them). The rows to send are packed from the caller's rows into those blocks by a
// kernel that reads the counts on the device, the blocks go through one grouped send/recv
// (Comm::device_alltoall), and a kernel unpacks the received blocks into the destination layout.
// The per-expert counts travel first, with an all-gather of every rank's offsets.
//
// Buffers: `stage` (the caller's rows, reused for the received blocks once they are packed) and
// `send` (the packed blocks): max(max_rows, W x pair_rows) + W x pair_rows rows.
#pragma once

#include "sparsetron/parallel/expert/expert_exchange.h"

namespace sparsetron::cuda {

class NcclExpertExchange final : public ExpertExchange {
  public:
    // `ep` must have device collectives (Comm::on_device: NCCL).
    NcclExpertExchange(Comm& ep, const ExchangeShape& shape);
    ~NcclExpertExchange() override;

    ExchangeTransport transport() const override { return ExchangeTransport::Nccl; }
    int64_t device_bytes() const override { return bytes_for(shape_, size_); }
    static int64_t bytes_for(const ExchangeShape& shape, int ranks);

    bf16* begin_send(const ExecContext& ctx) override;
    void dispatch(const ExecContext& ctx, const int32_t* offsets, int32_t* all_offsets,
                  int32_t* recv_offsets, bf16* y) override;
    void dispatch_again(const ExecContext& ctx, const int32_t* all_offsets, bf16* y) override;
    void combine(const ExecContext& ctx, const int32_t* all_offsets, bf16* x) override;

  private:
    // Packs the staged rows into the send blocks, exchanges the blocks into the stage, unpacks
    // them into `out`.
    template <bool Dispatch>
    void move(const ExecContext& ctx, const int32_t* all_offsets, bf16* out);
    Comm& ep_;
    bf16* stage_ = nullptr;  // [max(max_rows, W pair_rows), dim]
    bf16* send_ = nullptr;   // [W, pair_rows, dim]
};

}  // namespace sparsetron::cuda
