// What the flash-style sparse MQA kernels on wgmma (sparse_mqa_wgmma.cu forward,
// sparse_mqa_wgmma_bwd.cu backward) share: the GLM-5 shape, the 128-byte-swizzled [64 rows][64]
// slice tiles (wgmma.cuh's layout) that hold Q, dO and a 64-key chunk, the row copies into them,
// the descriptor offsets and the chunk's dot products (S = Q K^T, dP = dO V^T).
#pragma once

#include <cstdint>

#include "sparsetron/ops/attention/attention_plan.h"
#include "sparsetron/ops/common/wgmma.cuh"

namespace sparsetron::cuda::flash_mqa {

// Heads (the M), qk dim, v dim: the plan's flash shape.
constexpr int kH = int(kFlashHeads), kD = int(kFlashQkDim), kDv = int(kFlashVDim);
constexpr int kChunk = 64;             // keys per chunk
constexpr int kSlices = kD / 64;       // 9 slices of 64 dims (v: the first 8)
constexpr int kThreads = 256;          // two warpgroups
constexpr int kSliceBytes = 64 * 128;  // [64 rows][64] bf16
constexpr int kTileBytes = kSlices * kSliceBytes;

#ifdef ST_WGMMA
// A descriptor `bytes` further into its tile: the start address is the low 14 bits in 16-byte
// units, and every tile here ends below 256 KiB, so the add never carries out of the field.
__device__ __forceinline__ uint64_t desc_plus(uint64_t d, uint32_t bytes) {
    return d + (bytes >> 4);
}
// A K-major tile's descriptor (rows 128 B apart, 8-row groups 1024 B apart; k16 step: +32 B).
__device__ __forceinline__ uint64_t k_major(uint32_t addr) {
    return wgmma::descriptor(addr, 16, 1024);
}
// The same tile read MN-major (its rows are the reduction; k16 step: +2048 B; 64-wide atoms
// 8 KiB apart, so consecutive slices form one operand up to 256 wide).
__device__ __forceinline__ uint64_t mn_major(uint32_t addr) {
    return wgmma::descriptor(addr, 8192, 1024);
}

// The dynamic shared memory's first 1024-byte boundary (the 128-byte swizzle's 8-row atoms are
// 1024 B and its pattern follows the address bits), as a shared-window address and a generic
// pointer; kernels reserve 1024 bytes of slack for it.
struct SmemBase {
    uint32_t addr;
    unsigned char* ptr;
};
__device__ __forceinline__ SmemBase aligned_smem_base(unsigned char* raw) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
    const uint32_t base = (a + 1023u) & ~1023u;
    return {base, raw + (base - a)};
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
// Shared memory written by ordinary stores, made visible to the MMAs (before a barrier).
__device__ __forceinline__ void fence_async_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Every copy this block issued has landed and is visible to every thread and to the MMAs.
__device__ __forceinline__ void copies_landed() {
    asm volatile("cp.async.wait_group 0;\n" ::);
    fence_async_proxy();
    __syncthreads();
}

__device__ __forceinline__ void mma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// 64 rows of kSl x 64 bf16 into kSl swizzled slices at `tile`. Thread tid copies rows tid / 8 and
// tid / 8 + 32 (row[h]; valid[h] false: zeros, row[h] then any readable row), 16-byte piece
// tid % 8 of each slice: a warp's copy covers 4 whole 128-byte row segments, and the source
// offsets are constants (a per-piece index load and division sat on the forward's critical path).
template <int kSl>
__device__ __forceinline__ void load_rows(uint32_t tile, const bf* const (&row)[2],
                                          const bool (&valid)[2]) {
    const int w = threadIdx.x & 7;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = (threadIdx.x >> 3) + 32 * h;
        const uint32_t dst = tile + r * 128 + ((w ^ (r & 7)) << 4);
        const bf* src = row[h] + w * 8;
#pragma unroll
        for (int slice = 0; slice < kSl; ++slice)
            wgmma::cp_async16(dst + slice * kSliceBytes, src + slice * 64, valid[h]);
    }
}

// acc = A B^T over kSl slices: A the K-major [64 rows][kSl x 64] tile at da's address, B kAcc / 2
// key rows (32 or 64) of a K-major chunk at db's. Zeroes acc and fences (wgmma must see the
// zeros); issued only: the caller commits and waits. acc[4 i + 2 half + e] is row r0 + 8 half,
// key 8 i + 2 quad + e of the kAcc / 2.
template <int kSl, int kAcc>
__device__ __forceinline__ void chunk_dots(float (&acc)[kAcc], uint64_t da, uint64_t db) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
    mma_fence();
#pragma unroll
    for (int sl = 0; sl < kSl; ++sl)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const uint32_t off = sl * kSliceBytes + kk * 32;
            wgmma::mma_m64k16<0, 0>(acc, desc_plus(da, off), desc_plus(db, off));
        }
}

// The selected key of this thread's two rows (load_rows) in chunk c of a row of n keys
// (`sel`), -1 past n.
__device__ __forceinline__ void chunk_keys(const int32_t* sel, int64_t n, int64_t c,
                                           int32_t (&key)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int64_t j = c * kChunk + (threadIdx.x >> 3) + 32 * h;
        key[h] = j < n ? sel[j] : -1;
    }
}
// Gathers the chunk whose keys are `key` into the tile at `tile` (rows of kv; -1: zeros).
__device__ __forceinline__ void gather_chunk(uint32_t tile, const bf* kv, const int32_t (&key)[2]) {
    const bf* rows[2] = {kv + int64_t(max(key[0], 0)) * kD, kv + int64_t(max(key[1], 0)) * kD};
    const bool valid[2] = {key[0] >= 0, key[1] >= 0};
    load_rows<kSlices>(tile, rows, valid);
}
#endif

}  // namespace sparsetron::cuda::flash_mqa
