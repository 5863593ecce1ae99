// The expert exchange's common part (expert_exchange.h): the shape checks and the choice of
// implementation.
#include "sparsetron/parallel/expert/expert_exchange.h"

#include <cuda_runtime.h>

#include "sparsetron/core/cuda_check.h"
#include "sparsetron/core/error.h"
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/parallel/expert/ipc_expert_exchange.h"
#include "sparsetron/parallel/expert/nccl_expert_exchange.h"

namespace sparsetron::cuda {

ExpertExchange::ExpertExchange(const Comm& ep, const ExchangeShape& shape)
    : rank_(ep.rank()), size_(ep.size()), shape_(shape) {
    ST_CHECK(shape.experts % size_ == 0, "expert exchange: ", shape.experts, " experts over ",
             size_, " ranks");
    ST_CHECK(shape.dim % 8 == 0, "expert exchange: rows of ", shape.dim,
             " bf16 values (a multiple of 8 is needed for 16-byte copies)");
    ST_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&over_budget_), sizeof(int32_t)));
    ST_CUDA_CHECK(cudaMemset(over_budget_, 0, sizeof(int32_t)));
}

ExpertExchange::~ExpertExchange() {
    cudaFree(over_budget_);
}

void ExpertExchange::clear_over_budget(const ExecContext& ctx) const {
    ST_CUDA_CHECK(cudaMemsetAsync(over_budget_, 0, sizeof(int32_t), stream_of(ctx)));
}

std::unique_ptr<ExpertExchange> make_expert_exchange(ExchangeTransport t, Comm& ep,
                                                     const ExchangeShape& shape) {
    if (t == ExchangeTransport::Nccl) return std::make_unique<NcclExpertExchange>(ep, shape);
    return std::make_unique<IpcExpertExchange>(ep, shape);
}

int64_t expert_exchange_bytes(ExchangeTransport t, const ExchangeShape& shape, int ranks) {
    return t == ExchangeTransport::Nccl ? NcclExpertExchange::bytes_for(shape, ranks)
                                        : IpcExpertExchange::region_bytes_for(shape);
}

}  // namespace sparsetron::cuda
