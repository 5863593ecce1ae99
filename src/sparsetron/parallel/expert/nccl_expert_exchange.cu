// The expert exchange over NCCL (nccl_expert_exchange.h): pack kernels, one grouped send/recv
// of fixed-size blocks, unpack kernels.
#include <cuda_runtime.h>

#include <algorithm>

#include "sparsetron/core/cuda_check.h"
#include "sparsetron/core/error.h"
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/parallel/expert/expert_exchange_rows.cuh"
#include "sparsetron/parallel/expert/nccl_expert_exchange.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 256;

// Block s of `blocks` <-> this rank's source-layout rows of owner s's experts, in order (the
// dispatch's pack, the combine's unpack). One block row per peer s (blockIdx.y).
template <bool ToBlocks>
__global__ void block_rows_kernel(const int32_t* all_offsets, int ranks, int rank, int64_t experts,
                                  int64_t pair_rows, int64_t dim_vec, int4* rows, int4* blocks) {
    const int s = blockIdx.y;
    const int64_t el = experts / ranks;
    const int32_t* off = all_offsets + rank * (experts + 1);
    const int32_t first = off[s * el], last = exchange::pair_end(off, el, s, pair_rows);
    int4* block = blocks + s * pair_rows * dim_vec;
    const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
    for (int64_t i = first + int64_t(blockIdx.x) * warps + threadIdx.x / 32; i < last;
         i += int64_t(gridDim.x) * warps) {
        int4 *b = block + (i - first) * dim_vec, *r = rows + i * dim_vec;
        if (ToBlocks)
            exchange::copy_row(r, b, dim_vec, lane);
        else
            exchange::copy_row(b, r, dim_vec, lane);
    }
}

// Block p of `blocks` <-> the owner-layout rows this rank's experts hold from source p, in p's
// source-layout order (the dispatch's unpack, the combine's pack). One block row per source p.
template <bool ToBlocks>
__global__ void owner_rows_kernel(const int32_t* all_offsets, int ranks, int rank, int64_t experts,
                                  int64_t pair_rows, int64_t dim_vec, int4* rows, int4* blocks) {
    extern __shared__ int32_t base[];  // [El]: owner-layout first row of (p, j)
    const int p = blockIdx.y;
    const int64_t el = experts / ranks;
    const int32_t* off_p = all_offsets + p * (experts + 1);
    if (threadIdx.x == 0)
        exchange::owner_bases(all_offsets, ranks, experts, p, rank, pair_rows, base);
    __syncthreads();
    const int32_t first = off_p[rank * el], last = exchange::pair_end(off_p, el, rank, pair_rows);
    int4* block = blocks + p * pair_rows * dim_vec;
    const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
    for (int64_t i = first + int64_t(blockIdx.x) * warps + threadIdx.x / 32; i < last;
         i += int64_t(gridDim.x) * warps) {
        int4 *b = block + (i - first) * dim_vec,
             *r = rows + exchange::owner_row(off_p, el, rank, base, i) * dim_vec;
        if (ToBlocks)
            exchange::copy_row(r, b, dim_vec, lane);
        else
            exchange::copy_row(b, r, dim_vec, lane);
    }
}

__global__ void owner_offsets_kernel(const int32_t* all_offsets, int ranks, int rank,
                                     int64_t experts, int64_t pair_rows, int32_t* recv_offsets,
                                     int32_t* over_budget) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        exchange::owner_offsets(all_offsets, ranks, rank, experts, pair_rows, recv_offsets,
                                over_budget);
}

int4* vec(bf16* p) {
    return reinterpret_cast<int4*>(p);
}

}  // namespace

NcclExpertExchange::NcclExpertExchange(Comm& ep, const ExchangeShape& shape)
    : ExpertExchange(ep, shape), ep_(ep) {
    ST_CHECK(ep.on_device(), "the NCCL expert exchange needs device collectives; the ", ep.name(),
             " communicator has none");
    ST_CHECK(shape.pair_rows > 0, "expert exchange: no rows planned per pair of ranks");
    const int64_t stage_rows = std::max(shape.max_rows, size_ * shape.pair_rows);
    const size_t row = size_t(shape.dim) * sizeof(bf16);
    ST_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&stage_), size_t(stage_rows) * row));
    ST_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&send_), size_t(size_ * shape.pair_rows) * row));
}

NcclExpertExchange::~NcclExpertExchange() {
    cudaDeviceSynchronize();
    cudaFree(send_);
    cudaFree(stage_);
}

int64_t NcclExpertExchange::bytes_for(const ExchangeShape& s, int ranks) {
    const int64_t blocks = ranks * s.pair_rows;
    return (std::max(s.max_rows, blocks) + blocks) * s.dim * int64_t(sizeof(bf16));
}

bf16* NcclExpertExchange::begin_send(const ExecContext&) {
    return stage_;  // stream order: the previous exchange's unpack has read it
}

template <bool Dispatch>
void NcclExpertExchange::move(const ExecContext& ctx, const int32_t* all_offsets, bf16* out) {
    const cudaStream_t st = stream_of(ctx);
    const int64_t dim_vec = shape_.dim / 8, el = local_experts();
    const dim3 grid(unsigned(std::max(4, 2 * sm_count() / size_)), unsigned(size_));
    const size_t smem = size_t(el) * sizeof(int32_t);
    if (Dispatch)
        block_rows_kernel<true><<<grid, kThreads, 0, st>>>(all_offsets, size_, rank_,
                                                           shape_.experts, shape_.pair_rows,
                                                           dim_vec, vec(stage_), vec(send_));
    else
        owner_rows_kernel<true><<<grid, kThreads, smem, st>>>(all_offsets, size_, rank_,
                                                              shape_.experts, shape_.pair_rows,
                                                              dim_vec, vec(stage_), vec(send_));
    ST_CUDA_LAUNCH_CHECK();
    ep_.device_alltoall(send_, stage_, shape_.pair_rows * shape_.dim * int64_t(sizeof(bf16)),
                        ctx.stream);
    if (Dispatch)
        owner_rows_kernel<false><<<grid, kThreads, smem, st>>>(all_offsets, size_, rank_,
                                                               shape_.experts, shape_.pair_rows,
                                                               dim_vec, vec(out), vec(stage_));
    else
        block_rows_kernel<false><<<grid, kThreads, 0, st>>>(all_offsets, size_, rank_,
                                                            shape_.experts, shape_.pair_rows,
                                                            dim_vec, vec(out), vec(stage_));
    ST_CUDA_LAUNCH_CHECK();
}

void NcclExpertExchange::dispatch(const ExecContext& ctx, const int32_t* offsets,
                                  int32_t* all_offsets, int32_t* recv_offsets, bf16* y) {
    const int64_t stride = shape_.experts + 1;
    ST_CUDA_CHECK(cudaMemcpyAsync(all_offsets + rank_ * stride, offsets,
                                  size_t(stride) * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                                  stream_of(ctx)));
    ep_.device_allgather(all_offsets, stride * int64_t(sizeof(int32_t)), ctx.stream);
    owner_offsets_kernel<<<1, 32, 0, stream_of(ctx)>>>(
        all_offsets, size_, rank_, shape_.experts, shape_.pair_rows, recv_offsets, over_budget_);
    ST_CUDA_LAUNCH_CHECK();
    move<true>(ctx, all_offsets, y);
}

void NcclExpertExchange::dispatch_again(const ExecContext& ctx, const int32_t* all_offsets,
                                        bf16* y) {
    move<true>(ctx, all_offsets, y);
}

void NcclExpertExchange::combine(const ExecContext& ctx, const int32_t* all_offsets, bf16* x) {
    move<false>(ctx, all_offsets, x);
}

}  // namespace sparsetron::cuda
