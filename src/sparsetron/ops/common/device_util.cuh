// Small device helpers shared by the CUDA kernels: bf16 conversion, warp/block reductions,
// launch arithmetic. Only .cu files include this.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "sparsetron/core/cuda_check.h"
#include "sparsetron/core/dtype.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/cuda/device_caps.h"

namespace sparsetron::cuda {

using bf = __nv_bfloat16;
static_assert(sizeof(bf) == sizeof(bf16), "bf16 storage must match CUDA's");

inline cudaStream_t stream_of(const ExecContext& ctx) {
    return static_cast<cudaStream_t>(ctx.stream);
}
inline const bf* dev(const bf16* p) {
    return reinterpret_cast<const bf*>(p);
}
inline bf* dev(bf16* p) {
    return reinterpret_cast<bf*>(p);
}
inline unsigned blocks_for(int64_t n, int threads) {
    return static_cast<unsigned>((n + threads - 1) / threads);
}

// The current device's SM count, read once (persistent kernels launch one block per SM).
inline int sm_count() {
    static const int count = [] {
        int device = 0, sms = 0;
        ST_CUDA_CHECK(cudaGetDevice(&device));
        ST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        return sms;
    }();
    return count;
}

// Raises kKernel's dynamic shared memory limit (48 KiB by default) to `bytes`, once per kernel:
// the first call sets it, before any graph capture.
template <auto kKernel>
void allow_dynamic_smem(size_t bytes) {
    static const bool done = [bytes] {
        ST_CUDA_CHECK(
            cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
        return true;
    }();
    (void)done;
}

// A persistent launch in clusters of `cluster` blocks (cudaLaunchKernelEx): its configuration,
// which points at its own cluster attribute (hence neither copied nor moved).
struct ClusterLaunch {
    cudaLaunchAttribute attr{};
    cudaLaunchConfig_t config{};
    int cluster;
    ClusterLaunch(int threads, size_t smem_bytes, cudaStream_t stream, int cluster_blocks)
        : cluster(cluster_blocks) {
        config.blockDim = dim3(unsigned(threads));
        config.dynamicSmemBytes = smem_bytes;
        config.stream = stream;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = unsigned(cluster), attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        config.attrs = &attr, config.numAttrs = 1;
    }
    ClusterLaunch(const ClusterLaunch&) = delete;
    ClusterLaunch& operator=(const ClusterLaunch&) = delete;

    // For kKernel: its shared memory allowed, and a grid of at most `units` clusters and at most
    // `most` blocks (0: the blocks that may stay resident at once, whole clusters; the GPCs' SM
    // counts may leave some SMs out: asked of the driver once per kernel).
    template <auto kKernel>
    void size_grid(int64_t units, int64_t most) {
        allow_dynamic_smem<kKernel>(config.dynamicSmemBytes);
        static const int64_t resident = [this] {
            cudaLaunchConfig_t c = config;
            c.gridDim = dim3(unsigned(cluster * sm_count()));
            int clusters = 0;
            ST_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kKernel, &c));
            ST_CHECK(clusters > 0, "no cluster of ", cluster, " blocks fits on this GPU");
            return int64_t(clusters) * cluster;
        }();
        const int64_t cap = most > 0 ? most : resident;
        config.gridDim = dim3(unsigned(std::min<int64_t>(units, cap / cluster) * cluster));
    }
};

__device__ __forceinline__ float ld(const bf* p) {
    return __bfloat162float(*p);
}
__device__ __forceinline__ float ld(const float* p) {
    return *p;
}
__device__ __forceinline__ void st(bf* p, float v) {
    *p = __float2bfloat16(v);
}
__device__ __forceinline__ void st(float* p, float v) {
    *p = v;
}
// IEEE half: only the Gram form of Muon's Newton-Schulz stores it (muon_batch.cu).
__device__ __forceinline__ float ld(const __half* p) {
    return __half2float(*p);
}
__device__ __forceinline__ void st(__half* p, float v) {
    *p = __float2half_rn(v);
}

// Eight bf16 as one 16-byte access, unpacked to / packed from floats (round to nearest even).
union Bf16x8 {
    uint4 v;
    __nv_bfloat162 p[4];
};
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
    Bf16x8 u;
    u.v = v;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 x = __bfloat1622float2(u.p[j]);
        f[2 * j] = x.x, f[2 * j + 1] = x.y;
    }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    Bf16x8 u;
#pragma unroll
    for (int j = 0; j < 4; ++j) u.p[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return u.v;
}
// Whether every pointer is 16-byte aligned (the 8-wide bf16 vector kernels' precondition, with
// element counts and strides that are multiples of 8).
template <typename... P>
inline bool aligned16(const P*... ptrs) {
    return ((reinterpret_cast<uintptr_t>(ptrs) % 16 == 0) && ...);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// The order of additions is fixed by the thread layout, so results are deterministic.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the previous call's readers are done with part/total
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float x = lane < int(blockDim.x >> 5) ? part[lane] : 0.f;
        x = warp_sum(x);
        if (lane == 0) total = x;
    }
    __syncthreads();
    return total;
}
__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[32];
    __shared__ float total;
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float x = lane < int(blockDim.x >> 5) ? part[lane] : -INFINITY;
        x = warp_max(x);
        if (lane == 0) total = x;
    }
    __syncthreads();
    return total;
}

// Online softmax statistics: the running max mx and the sum l of exp(x - mx) over the values
// seen; add one value, or merge another partial (mx = -inf: nothing seen).
__device__ __forceinline__ void online_add(float& mx, float& l, float x) {
    if (x > mx) {
        l = l * __expf(mx - x) + 1.f;
        mx = x;
    } else {
        l += __expf(x - mx);
    }
}
__device__ __forceinline__ void online_merge(float& mx, float& l, float m2, float l2) {
    const float mm = fmaxf(mx, m2);
    l = (mx == -INFINITY ? 0.f : l * __expf(mx - mm)) +
        (m2 == -INFINITY ? 0.f : l2 * __expf(m2 - mm));
    mx = mm;
}

}  // namespace sparsetron::cuda
