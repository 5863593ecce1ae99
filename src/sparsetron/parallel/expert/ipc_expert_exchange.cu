// The expert exchange over CUDA IPC (ipc_expert_exchange.h): shared regions, epoch flags at
// system scope, and pull kernels that read peers' rows over NVLink.
#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>

#include "sparsetron/core/cuda_check.h"
#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/parallel/expert/expert_exchange_rows.cuh"
#include "sparsetron/parallel/expert/ipc_expert_exchange.h"

namespace sparsetron::cuda {
namespace {

// Region layout: the publish flag, the done flag (own 128-byte lines), the published offsets,
// then the rows.
constexpr int64_t kPublishAt = 0, kDoneAt = 128, kOffsetsAt = 256;
constexpr int kThreads = 256;
constexpr int kPullBlocksPerPeer = 132;
constexpr unsigned long long kTimeoutNs = 60ull * 1000 * 1000 * 1000;

int64_t rows_at(int64_t experts) {
    return (kOffsetsAt + 4 * (experts + 1) + 255) / 256 * 256;
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
// Spins until *flag >= want; traps after a minute (a peer died or diverged).
__device__ void wait_flag(const uint32_t* flag, uint32_t want) {
    const unsigned long long start = now_ns();
    while (load_acquire(flag) < want)
        if (now_ns() - start > kTimeoutNs) {
            printf("sparsetron: expert exchange waited 60 s for a peer (flag %u < %u)\n",
                   load_acquire(flag), want);
            asm volatile("trap;");
        }
}
__device__ __forceinline__ uint32_t* flag_of(void* region, int64_t at) {
    return reinterpret_cast<uint32_t*>(static_cast<char*>(region) + at);
}

// Every peer has finished reading this rank's previous publication; then the next epoch.
__global__ void begin_kernel(void* const* peers, int ranks, uint32_t* epoch) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint32_t e = *epoch;
    for (int s = 0; s < ranks; ++s) wait_flag(flag_of(peers[s], kDoneAt), e);
    *epoch = e + 1;
}

// The offsets (a dispatch) next to the rows, then the flag: everything written before is
// visible to a peer that sees the flag.
__global__ void publish_kernel(void* region, const int32_t* offsets, int64_t experts,
                               const uint32_t* epoch) {
    if (offsets) {
        int32_t* o = reinterpret_cast<int32_t*>(static_cast<char*>(region) + kOffsetsAt);
        for (int64_t e = threadIdx.x; e <= experts; e += blockDim.x) o[e] = offsets[e];
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    __threadfence_system();
    store_release(flag_of(region, kPublishAt), *epoch);
}

__global__ void finish_kernel(void* region, const uint32_t* epoch) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    __threadfence_system();
    store_release(flag_of(region, kDoneAt), *epoch);
}

// Every peer has published this epoch. One block waits, so that the pull after it holds no SM
// while a peer is late: a pull grid spinning on every SM would keep out the kernels of other
// streams (a peer rank's, where ranks share a GPU) that need a whole SM's shared memory.
__global__ void wait_published_kernel(void* const* peers, int ranks, const uint32_t* epoch) {
    const uint32_t e = *epoch;
    for (int s = threadIdx.x; s < ranks; s += blockDim.x)
        wait_flag(flag_of(peers[s], kPublishAt), e);
}

// Every rank's published offsets into all_offsets [W, E + 1]; this rank's owner layout.
__global__ void gather_offsets_kernel(void* const* peers, int ranks, int rank, int64_t experts,
                                      int64_t pair_rows, const uint32_t* epoch,
                                      int32_t* all_offsets, int32_t* recv_offsets,
                                      int32_t* over_budget) {
    const uint32_t e = *epoch;
    if (threadIdx.x == 0)
        for (int s = 0; s < ranks; ++s) wait_flag(flag_of(peers[s], kPublishAt), e);
    __syncthreads();
    for (int s = 0; s < ranks; ++s) {
        const int32_t* o =
            reinterpret_cast<const int32_t*>(static_cast<const char*>(peers[s]) + kOffsetsAt);
        for (int64_t i = threadIdx.x; i <= experts; i += blockDim.x)
            all_offsets[s * (experts + 1) + i] = __ldcv(o + i);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        exchange::owner_offsets(all_offsets, ranks, rank, experts, pair_rows, recv_offsets,
                                over_budget);
}

// One block row per peer s (blockIdx.y), after a kernel that waited for every peer's publication
// of this epoch. Dispatch: this rank q pulls its experts' rows from source s's region (source
// layout) into y (owner layout). Combine: this rank p pulls its rows back from owner s's region
// (owner layout) into x (source layout).
template <bool Dispatch>
__global__ void pull_kernel(void* const* peers, int ranks, int rank, int64_t experts,
                            int64_t pair_rows, int64_t rows_off, int64_t dim_vec,
                            const int32_t* all_offsets, int4* out) {
    extern __shared__ int32_t base[];  // [El]: owner-layout first row of (p, j)
    const int s = blockIdx.y;
    const int p = Dispatch ? s : rank, q = Dispatch ? rank : s;
    const int64_t el = experts / ranks;
    const int32_t* off_p = all_offsets + p * (experts + 1);
    if (threadIdx.x == 0) exchange::owner_bases(all_offsets, ranks, experts, p, q, pair_rows, base);
    __syncthreads();
    const int32_t first = off_p[q * el], last = exchange::pair_end(off_p, el, q, pair_rows);
    const int4* peer = reinterpret_cast<const int4*>(static_cast<const char*>(peers[s]) + rows_off);
    const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
    for (int64_t i = first + int64_t(blockIdx.x) * warps + threadIdx.x / 32; i < last;
         i += int64_t(gridDim.x) * warps) {
        const int64_t o = exchange::owner_row(off_p, el, q, base, i);
        const int64_t src = Dispatch ? i : o, dst = Dispatch ? o : i;
        exchange::copy_row(peer + src * dim_vec, out + dst * dim_vec, dim_vec, lane);
    }
}

}  // namespace

IpcExpertExchange::IpcExpertExchange(Comm& ep, const ExchangeShape& shape)
    : ExpertExchange(ep, shape) {
    region_bytes_ = region_bytes_for(shape);
    ST_CUDA_CHECK(cudaMalloc(&region_, size_t(region_bytes_)));
    ST_CUDA_CHECK(cudaMemset(region_, 0, size_t(rows_at(shape.experts))));
    ST_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&epoch_), sizeof(uint32_t)));
    ST_CUDA_CHECK(cudaMemset(epoch_, 0, sizeof(uint32_t)));
    ST_CUDA_CHECK(cudaDeviceSynchronize());
    // Each rank's region: an IPC handle for ranks in other processes; ranks that are threads of
    // this process (a CUDA IPC handle does not open in the process that made it) use the
    // pointer, with peer access where they sit on another GPU.
    struct Region {
        cudaIpcMemHandle_t handle{};
        int64_t process = 0;
        int device = 0;
        void* ptr = nullptr;
    } mine;
    ST_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, region_));
    mine.process = int64_t(getpid());
    ST_CUDA_CHECK(cudaGetDevice(&mine.device));
    mine.ptr = region_;
    std::vector<void*> all(size_t(size_), nullptr);
    for (int s = 0; s < size_; ++s) {
        Region r = mine;
        ep.broadcast(&r, sizeof r, s);
        if (s == rank_) {
            all[size_t(s)] = region_;
            continue;
        }
        if (r.process == mine.process) {
            // A lazily loaded kernel's first launch synchronizes the whole context: in one
            // process it would wait for a peer thread's kernel spinning on this rank's flag.
            ST_CHECK(env_value("CUDA_MODULE_LOADING") == "EAGER", "expert exchange: rank ", rank_,
                     " and rank ", s,
                     " are threads of one process, which needs CUDA_MODULE_LOADING=EAGER set "
                     "before CUDA starts (lazy loading's context synchronization would deadlock "
                     "against the exchange's spinning kernels)");
            if (r.device != mine.device) {
                const cudaError_t st = cudaDeviceEnablePeerAccess(r.device, 0);
                ST_CHECK(st == cudaSuccess || st == cudaErrorPeerAccessAlreadyEnabled,
                         "expert exchange: rank ", rank_, " cannot reach rank ", s, "'s GPU ",
                         r.device, " (", cudaGetErrorString(st),
                         "): GPU expert parallelism needs peer access between the group's GPUs");
                cudaGetLastError();  // an already-enabled peer is not an error here
            }
            all[size_t(s)] = r.ptr;
            continue;
        }
        void* p = nullptr;
        const cudaError_t st = cudaIpcOpenMemHandle(&p, r.handle, cudaIpcMemLazyEnablePeerAccess);
        ST_CHECK(st == cudaSuccess, "expert exchange: rank ", rank_, " cannot map rank ", s,
                 "'s GPU memory (", cudaGetErrorString(st),
                 "): GPU expert parallelism needs the expert-parallel group on one node "
                 "with peer access between its GPUs");
        opened_.push_back(p);
        all[size_t(s)] = p;
    }
    ST_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&peers_), all.size() * sizeof(void*)));
    ST_CUDA_CHECK(
        cudaMemcpy(peers_, all.data(), all.size() * sizeof(void*), cudaMemcpyHostToDevice));
    // Every rank has mapped every region before any exchange starts.
    char ready = 1;
    ep.broadcast(&ready, 1, 0);
}

int64_t IpcExpertExchange::region_bytes_for(const ExchangeShape& s) {
    return rows_at(s.experts) + s.max_rows * s.dim * int64_t(sizeof(bf16));
}

IpcExpertExchange::~IpcExpertExchange() {
    cudaDeviceSynchronize();
    for (void* p : opened_) cudaIpcCloseMemHandle(p);
    cudaFree(peers_);
    cudaFree(epoch_);
    cudaFree(region_);
}

bf16* IpcExpertExchange::begin_send(const ExecContext& ctx) {
    begin_kernel<<<1, 32, 0, stream_of(ctx)>>>(peers_, size_, epoch_);
    ST_CUDA_LAUNCH_CHECK();
    return reinterpret_cast<bf16*>(static_cast<char*>(region_) + rows_at(shape_.experts));
}

void IpcExpertExchange::publish(const ExecContext& ctx, const int32_t* offsets) {
    publish_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(region_, offsets, shape_.experts, epoch_);
    ST_CUDA_LAUNCH_CHECK();
}

template <bool Dispatch>
void IpcExpertExchange::pull(const ExecContext& ctx, const int32_t* all_offsets, bf16* out) {
    const dim3 grid(kPullBlocksPerPeer, unsigned(size_));
    pull_kernel<Dispatch><<<grid, kThreads, local_experts() * sizeof(int32_t), stream_of(ctx)>>>(
        peers_, size_, rank_, shape_.experts, shape_.pair_rows, rows_at(shape_.experts),
        shape_.dim / 8, all_offsets, reinterpret_cast<int4*>(out));
    ST_CUDA_LAUNCH_CHECK();
}

void IpcExpertExchange::wait_published(const ExecContext& ctx) {
    wait_published_kernel<<<1, 32, 0, stream_of(ctx)>>>(peers_, size_, epoch_);
    ST_CUDA_LAUNCH_CHECK();
}

void IpcExpertExchange::finish(const ExecContext& ctx) {
    finish_kernel<<<1, 32, 0, stream_of(ctx)>>>(region_, epoch_);
    ST_CUDA_LAUNCH_CHECK();
}

void IpcExpertExchange::dispatch(const ExecContext& ctx, const int32_t* offsets,
                                 int32_t* all_offsets, int32_t* recv_offsets, bf16* y) {
    publish(ctx, offsets);
    gather_offsets_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(peers_, size_, rank_, shape_.experts,
                                                              shape_.pair_rows, epoch_, all_offsets,
                                                              recv_offsets, over_budget_);
    ST_CUDA_LAUNCH_CHECK();  // it waited for every peer's publication
    pull<true>(ctx, all_offsets, y);
    finish(ctx);
}

void IpcExpertExchange::dispatch_again(const ExecContext& ctx, const int32_t* all_offsets,
                                       bf16* y) {
    publish(ctx, nullptr);
    wait_published(ctx);
    pull<true>(ctx, all_offsets, y);
    finish(ctx);
}

void IpcExpertExchange::combine(const ExecContext& ctx, const int32_t* all_offsets, bf16* x) {
    publish(ctx, nullptr);
    wait_published(ctx);
    pull<false>(ctx, all_offsets, x);
    finish(ctx);
}

}  // namespace sparsetron::cuda
