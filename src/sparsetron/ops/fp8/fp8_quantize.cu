// FP8 blockwise quantization on the device (the CPU reference is ops/fp8/fp8.h, which
// these kernels match bit for bit): one fp32 scale per 1x128 block of an activation row and per
// 128x128 block of a weight, e4m3 with round-to-nearest-even and saturation to +-448
// (__NV_SATFINITE), scales by Transformer Engine's rule with correctly rounded divisions, so
// the result does not depend on fast-math flags. The scales are written where cuBLASLt's
// block-scaled GEMM reads them (ops/fp8/scale_layout.h).
#include <cuda_fp8.h>

#include <cstdlib>
#include <string>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/fp8_block.cuh"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace sparsetron::cuda {
namespace {

constexpr int kBlock = 128;

using fp8_dev::pack4;
using fp8_dev::scale_from_amax;
using fp8_dev::to_e4m3;

// One warp per (row, 128-column block), 8 blocks to a CTA: a lane holds 4 consecutive values
// (one 8-byte load when the row allows it), the block's amax is a warp reduction, the 4 codes
// leave as one 4-byte store (a CTA per block with a CTA-wide reduction is latency-bound).
__global__ void quantize_1x128_kernel(const bf* x, int64_t rows, int64_t cols, int64_t ld,
                                      bool pow2, bool vec, uint8_t* q, float* scale_inv) {
    const int64_t nb = (cols + kBlock - 1) / kBlock;
    const int64_t unit = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (unit >= rows * nb) return;
    const int lane = threadIdx.x & 31;
    const int64_t r = unit / nb, b = unit % nb, c = b * kBlock + lane * 4;
    float v[4];
    if (vec && c + 3 < cols) {
        const uint2 raw = *reinterpret_cast<const uint2*>(x + r * ld + c);
        const bf* h = reinterpret_cast<const bf*>(&raw);
        for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(h[i]);
    } else {
        for (int i = 0; i < 4; ++i) v[i] = c + i < cols ? __bfloat162float(x[r * ld + c + i]) : 0.f;
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    const float s = scale_from_amax(warp_max(amax), pow2);
    uint8_t out[4];
    for (int i = 0; i < 4; ++i) out[i] = to_e4m3(v[i] * s);
    if (vec && c + 3 < cols) {
        *reinterpret_cast<uint32_t*>(q + r * cols + c) = uint32_t(out[0]) | uint32_t(out[1]) << 8 |
                                                         uint32_t(out[2]) << 16 |
                                                         uint32_t(out[3]) << 24;
    } else {
        for (int i = 0; i < 4; ++i)
            if (c + i < cols) q[r * cols + c + i] = out[i];
    }
    if (lane == 0) scale_inv[fp8::scale_index_1x128(r, b, rows)] = __fdiv_rn(1.f, s);
}

// The wide form (rows of 8-aligned width): 16 lanes per (row, 128-column block), each with 8
// consecutive values (one 16-byte load, one 8-byte store), kWideUnits units per thread with every
// load issued before the first reduction, units numbered down the block columns (u = b * rows +
// r) so the lanes writing scales write consecutive floats (the GEMM layout keeps a block
// column's rows contiguous). The warp-per-block form above keeps one 8-byte load in flight per
// lane and scatters its scales a column apart.
constexpr int kWideUnits = 2;
constexpr int kWideThreads = 256;
__global__ void __launch_bounds__(kWideThreads, 8)
    quantize_1x128_wide_kernel(const bf* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                               bool pow2, uint8_t* __restrict__ q, float* __restrict__ scale_inv) {
    const int64_t units = rows * ((cols + kBlock - 1) / kBlock);
    const int sub = threadIdx.x & 15;
    const int64_t groups = int64_t(gridDim.x) * (kWideThreads / 16);
    const int64_t group = int64_t(blockIdx.x) * (kWideThreads / 16) + (threadIdx.x >> 4);
    uint4 raw[kWideUnits];
    int64_t at[kWideUnits];  // element offset of the lane's 8 values in x (-1: none)
#pragma unroll
    for (int i = 0; i < kWideUnits; ++i) {
        const int64_t u = group + i * groups, r = u % rows, c = (u / rows) * kBlock + sub * 8;
        at[i] = u < units && c < cols ? r * ld + c : -1;
        raw[i] = at[i] >= 0 ? *reinterpret_cast<const uint4*>(x + at[i]) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kWideUnits; ++i) {
        float v[8];
        unpack8(raw[i], v);
        // Every lane reaches the shuffles (those without a unit hold zeros and store nothing).
        const fp8_dev::HalfWarpBlock blk = fp8_dev::quantize_half_warp_block(v, pow2);
        if (at[i] < 0) continue;
        const int64_t u = group + i * groups, r = u % rows, b = u / rows;
        *reinterpret_cast<uint2*>(q + r * cols + b * kBlock + sub * 8) = blk.codes;
        if (sub == 0) scale_inv[fp8::scale_index_1x128(r, b, rows)] = blk.scale_inv;
    }
}

// One block of 256 threads per 128x128 tile. `transposed`: q is w^T [cols, rows] and the scales
// are w^T's (the same blocks, so the same values: w^T's 128x128 quantization bit for bit); the
// second sweep walks the tile column by column so the byte stores stay coalesced.
__global__ void quantize_128x128_kernel(const float* w, int64_t rows, int64_t cols, bool pow2,
                                        bool transposed, uint8_t* q, float* scale_inv) {
    const int64_t r0 = int64_t(blockIdx.x) * kBlock, c0 = int64_t(blockIdx.y) * kBlock;
    float amax = 0.f;
    for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
        const int64_t r = r0 + i / kBlock, c = c0 + i % kBlock;
        if (r < rows && c < cols) amax = fmaxf(amax, fabsf(w[r * cols + c]));
    }
    const float s = scale_from_amax(block_max(amax), pow2);
    if (transposed) {
        for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
            const int64_t c = c0 + i / kBlock, r = r0 + i % kBlock;
            if (r < rows && c < cols) q[c * rows + r] = to_e4m3(w[r * cols + c] * s);
        }
        if (threadIdx.x == 0)
            scale_inv[fp8::scale_index_128x128(blockIdx.y, blockIdx.x, rows)] = __fdiv_rn(1.f, s);
        return;
    }
    for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
        const int64_t r = r0 + i / kBlock, c = c0 + i % kBlock;
        if (r < rows && c < cols) q[r * cols + c] = to_e4m3(w[r * cols + c] * s);
    }
    if (threadIdx.x == 0)
        scale_inv[fp8::scale_index_128x128(blockIdx.x, blockIdx.y, cols)] = __fdiv_rn(1.f, s);
}

// Both orientations of a weight from one read: the 128x128 fp32 tile in shared memory (rows
// padded to 129 floats: the column sweep is conflict-free), the block amax, then q row by row
// and q^T column by column, both with coalesced byte stores. The weights are quantized every
// step: one fp32 read instead of the two-kernel form's four.
constexpr int kTileLd = kBlock + 1;
constexpr size_t kBothSmem = size_t(kBlock) * kTileLd * sizeof(float);
// vec (rows and cols multiples of 4, w 16-byte aligned): 16-byte loads, 4-byte code stores.
__global__ void quantize_128x128_both_kernel(const float* w, int64_t rows, int64_t cols, bool pow2,
                                             bool vec, uint8_t* q, float* scale_inv, uint8_t* qt,
                                             float* scale_inv_t) {
    extern __shared__ float wt[];  // [128][kTileLd]
    const int64_t r0 = int64_t(blockIdx.x) * kBlock, c0 = int64_t(blockIdx.y) * kBlock;
    constexpr int kQuads = kBlock * kBlock / 4;
    float amax = 0.f;
    if (vec) {
        for (int i = threadIdx.x; i < kQuads; i += blockDim.x) {
            const int r = i / (kBlock / 4), c = (i % (kBlock / 4)) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r0 + r < rows && c0 + c < cols)
                v = *reinterpret_cast<const float4*>(w + (r0 + r) * cols + c0 + c);
            float* d = wt + r * kTileLd + c;
            d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
    } else {
        for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
            const int r = i / kBlock, c = i % kBlock;
            const float v = r0 + r < rows && c0 + c < cols ? w[(r0 + r) * cols + c0 + c] : 0.f;
            wt[r * kTileLd + c] = v;
            amax = fmaxf(amax, fabsf(v));
        }
    }
    const float s = scale_from_amax(block_max(amax), pow2);  // its barriers publish the tile
    if (vec) {
        // Four consecutive codes per thread: a row's four columns, then a column's four rows.
        for (int i = threadIdx.x; i < kQuads; i += blockDim.x) {
            const int r = i / (kBlock / 4), c = (i % (kBlock / 4)) * 4;
            if (r0 + r >= rows || c0 + c >= cols) continue;
            uint8_t b[4];
            for (int j = 0; j < 4; ++j) b[j] = to_e4m3(wt[r * kTileLd + c + j] * s);
            *reinterpret_cast<uint32_t*>(q + (r0 + r) * cols + c0 + c) = pack4(b);
        }
        for (int i = threadIdx.x; i < kQuads; i += blockDim.x) {
            const int c = i / (kBlock / 4), r = (i % (kBlock / 4)) * 4;
            if (r0 + r >= rows || c0 + c >= cols) continue;
            uint8_t b[4];
            for (int j = 0; j < 4; ++j) b[j] = to_e4m3(wt[(r + j) * kTileLd + c] * s);
            *reinterpret_cast<uint32_t*>(qt + (c0 + c) * rows + r0 + r) = pack4(b);
        }
    } else {
        for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
            const int r = i / kBlock, c = i % kBlock;
            if (r0 + r < rows && c0 + c < cols)
                q[(r0 + r) * cols + c0 + c] = to_e4m3(wt[r * kTileLd + c] * s);
        }
        for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
            const int c = i / kBlock, r = i % kBlock;
            if (r0 + r < rows && c0 + c < cols)
                qt[(c0 + c) * rows + r0 + r] = to_e4m3(wt[r * kTileLd + c] * s);
        }
    }
    if (threadIdx.x == 0) {
        const float inv = __fdiv_rn(1.f, s);
        scale_inv[fp8::scale_index_128x128(blockIdx.x, blockIdx.y, cols)] = inv;
        scale_inv_t[fp8::scale_index_128x128(blockIdx.y, blockIdx.x, rows)] = inv;
    }
}

// The tiled form of both orientations (rows a multiple of 32, cols of 4; w, qt 16-byte and q
// 4-byte aligned): the tile unpadded in shared memory, copied in as float4 rows (four wavefronts
// a warp, the fewest) and read back the same way for the amax and q, q^T with a lane per column
// and 32 consecutive rows per thread: consecutive lanes read consecutive words (no bank
// conflicts) and each thread stores one 32-byte sector of w^T's row. The padded form above stores
// and reads its tile with four-way conflicts (three passes): shared memory, not HBM, bounds it.
constexpr int kTiledThreads = 512;
constexpr int kTiledQuads = kBlock * kBlock / 4 / kTiledThreads;  // float4s per thread
constexpr size_t kTiledSmem = size_t(kBlock) * kBlock * sizeof(float);
__global__ void __launch_bounds__(kTiledThreads, 3)
    quantize_128x128_both_tiled_kernel(const float* __restrict__ w, int64_t rows, int64_t cols,
                                       bool pow2, uint8_t* __restrict__ q,
                                       float* __restrict__ scale_inv, uint8_t* __restrict__ qt,
                                       float* __restrict__ scale_inv_t, int64_t w_stride) {
    extern __shared__ float4 tile4[];  // [128][32]: row r's columns 4 to a float4
    const float* tile = reinterpret_cast<const float*>(tile4);
    {  // matrix blockIdx.z of a batch: its master, its packed outputs
        const int64_t m = blockIdx.z;
        w += m * w_stride;
        q += m * rows * cols;
        qt += m * rows * cols;
        scale_inv += m * fp8::scales_128x128(rows, cols);
        scale_inv_t += m * fp8::scales_128x128(cols, rows);
    }
    const int64_t r0 = int64_t(blockIdx.x) * kBlock, c0 = int64_t(blockIdx.y) * kBlock;
    // Straight into shared memory (cp.async, zero-filled past the edges): no registers hold the
    // tile in flight, so three blocks fit an SM and one stores while the others load.
#pragma unroll
    for (int j = 0; j < kTiledQuads; ++j) {
        const int i = threadIdx.x + j * kTiledThreads, r = i / (kBlock / 4),
                  c = i % (kBlock / 4) * 4;
        const bool ok = r0 + r < rows && c0 + c < cols;
        const float* src = ok ? w + (r0 + r) * cols + c0 + c : w;
        const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(tile4 + i));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(ok ? 16 : 0));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // this thread's copies have landed
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kTiledQuads; ++j) {
        const float4 v = tile4[threadIdx.x + j * kTiledThreads];
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    const float s = scale_from_amax(block_max(amax), pow2);  // its barriers publish the tile
#pragma unroll
    for (int j = 0; j < kTiledQuads; ++j) {
        const int i = threadIdx.x + j * kTiledThreads, r = i / (kBlock / 4),
                  c = i % (kBlock / 4) * 4;
        if (r0 + r >= rows || c0 + c >= cols) continue;
        const float4 t = tile4[i];
        const uint8_t b[4] = {to_e4m3(t.x * s), to_e4m3(t.y * s), to_e4m3(t.z * s),
                              to_e4m3(t.w * s)};
        *reinterpret_cast<uint32_t*>(q + (r0 + r) * cols + c0 + c) = pack4(b);
    }
    const int c = threadIdx.x % kBlock, rb = threadIdx.x / kBlock * 32;
    if (c0 + c < cols && r0 + rb < rows) {  // rows % 32 == 0: all 32 rows or none
        uint32_t word[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            uint8_t b[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = to_e4m3(tile[(rb + 4 * k + j) * kBlock + c] * s);
            word[k] = pack4(b);
        }
        uint4* dst = reinterpret_cast<uint4*>(qt + (c0 + c) * rows + r0 + rb);
        dst[0] = make_uint4(word[0], word[1], word[2], word[3]);
        dst[1] = make_uint4(word[4], word[5], word[6], word[7]);
    }
    if (threadIdx.x == 0) {
        const float inv = __fdiv_rn(1.f, s);
        scale_inv[fp8::scale_index_128x128(blockIdx.x, blockIdx.y, cols)] = inv;
        scale_inv_t[fp8::scale_index_128x128(blockIdx.y, blockIdx.x, rows)] = inv;
    }
}

constexpr int kColTile = 64;  // columns per block of the column quantizers
// The scale of column c of an fp32 tile of 128 rows, four adjacent lanes per column (`part`: this
// lane's quarter of the rows); every lane of the four gets it.
__device__ __forceinline__ float column_scale(const float (&tile)[kBlock][kColTile + 1], int c,
                                              int part, bool pow2) {
    float amax = 0.f;
    for (int r = part * 32; r < part * 32 + 32; ++r) amax = fmaxf(amax, fabsf(tile[r][c]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    return scale_from_amax(amax, pow2);
}

// 1x128 blocks down the columns of x [rows, cols] (128 consecutive rows of one column: the
// contraction of a weight gradient runs over tokens), written as the transposed operand
// q [cols, rows] with its GEMM-layout scales. A block of 256 threads per 128-row x 64-column
// tile: the tile in shared memory (fp32, padded rows), four threads per column for the amax
// (one quarter of the rows each, shuffle-reduced), then each thread writes 32 consecutive codes
// of its column's row range (8 four-byte stores).
// vec (cols and ld multiples of 8, x 16-byte aligned): eight bf16 per 16-byte load.
__global__ void quantize_1x128_columns_kernel(const bf* x, int64_t rows, int64_t cols, int64_t ld,
                                              bool pow2, bool vec, uint8_t* q, float* scale_inv) {
    __shared__ float tile[kBlock][kColTile + 1];
    const int64_t r0 = int64_t(blockIdx.x) * kBlock, c0 = int64_t(blockIdx.y) * kColTile;
    if (vec) {
        for (int i = threadIdx.x; i < kBlock * kColTile / 8; i += blockDim.x) {
            const int r = i / (kColTile / 8), c = (i % (kColTile / 8)) * 8;
            uint4 raw = make_uint4(0, 0, 0, 0);
            if (r0 + r < rows && c0 + c < cols)
                raw = *reinterpret_cast<const uint4*>(x + (r0 + r) * ld + c0 + c);
            const bf* h = reinterpret_cast<const bf*>(&raw);
            for (int j = 0; j < 8; ++j) tile[r][c + j] = __bfloat162float(h[j]);
        }
    } else {
        for (int i = threadIdx.x; i < kBlock * kColTile; i += blockDim.x) {
            const int r = i / kColTile, c = i % kColTile;
            tile[r][c] =
                r0 + r < rows && c0 + c < cols ? __bfloat162float(x[(r0 + r) * ld + c0 + c]) : 0.f;
        }
    }
    __syncthreads();
    const int c = threadIdx.x / 4, part = threadIdx.x % 4;  // 4 adjacent lanes per column
    const float s = column_scale(tile, c, part, pow2);
    const int64_t col = c0 + c;
    if (col >= cols) return;
    for (int r = part * 32; r < part * 32 + 32; r += 4) {
        uint8_t out[4];
        for (int i = 0; i < 4; ++i) out[i] = to_e4m3(tile[r + i][c] * s);
        const int64_t row = r0 + r;
        if (row + 3 < rows && rows % 4 == 0) {
            *reinterpret_cast<uint32_t*>(q + col * rows + row) = pack4(out);
        } else {
            for (int i = 0; i < 4; ++i)
                if (row + i < rows) q[col * rows + row + i] = out[i];
        }
    }
    if (part == 0) scale_inv[fp8::scale_index_1x128(col, blockIdx.x, cols)] = __fdiv_rn(1.f, s);
}

// The experts' form of the column quantizer: block (b, c) quantizes padded 128-row block b of
// x^T's rows (the segment of the expert it falls in, rows past the expert's read as zero) for
// columns c * kColTile..; blocks past the last segment return. Thread 0 finds the expert by
// walking the offsets (a few hundred at most) and hands it to the block.
__global__ void quantize_1x128_expert_columns_kernel(const bf* x, const int32_t* offsets,
                                                     int64_t experts, int64_t cols, int64_t ld,
                                                     int64_t padded, bool pow2, uint8_t* q,
                                                     float* scale_inv) {
    __shared__ float tile[kBlock][kColTile + 1];
    __shared__ int64_t seg[2];  // the block's first source row and its valid rows (0: none)
    const int64_t p0 = int64_t(blockIdx.x) * kBlock, c0 = int64_t(blockIdx.y) * kColTile;
    if (threadIdx.x == 0) {
        seg[0] = 0, seg[1] = 0;
        int64_t start = 0;  // the expert's first padded row
        for (int64_t e = 0; e < experts; ++e) {
            const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
            const int64_t span = (rows + kBlock - 1) / kBlock * kBlock;
            if (p0 < start + span) {
                const int64_t local = p0 - start;
                seg[0] = r0 + local, seg[1] = min(int64_t(kBlock), rows - local);
                break;
            }
            start += span;
        }
    }
    __syncthreads();
    const int64_t src = seg[0], valid = seg[1];
    if (valid == 0) return;
    for (int i = threadIdx.x; i < kBlock * kColTile; i += blockDim.x) {
        const int r = i / kColTile, c = i % kColTile;
        tile[r][c] =
            r < valid && c0 + c < cols ? __bfloat162float(x[(src + r) * ld + c0 + c]) : 0.f;
    }
    __syncthreads();
    const int c = threadIdx.x / 4, part = threadIdx.x % 4;  // 4 adjacent lanes per column
    const float s = column_scale(tile, c, part, pow2);
    const int64_t col = c0 + c;
    if (col >= cols) return;
    for (int r = part * 32; r < part * 32 + 32; r += 4) {
        uint8_t out[4];
        for (int i = 0; i < 4; ++i) out[i] = to_e4m3(tile[r + i][c] * s);
        // padded is a multiple of 128: whole 4-byte words, 4-aligned.
        *reinterpret_cast<uint32_t*>(q + col * padded + p0 + r) = pack4(out);
    }
    if (part == 0) scale_inv[fp8::scale_index_1x128(col, blockIdx.x, cols)] = __fdiv_rn(1.f, s);
}

// The tiled form of the column quantizer (rows a multiple of 32; cols and ld of 8; x and q
// 16-byte aligned): the 128 x 64 tile kept in bf16 in shared memory, unpadded (16-byte row stores:
// four wavefronts a warp), then a lane per column and a quarter of the rows per warp (consecutive
// lanes read consecutive bf16: no bank conflicts), the column's amax across the four quarters
// through shared memory, and each thread's 32 codes as two 16-byte stores (one 32-byte sector of
// x^T's row). The form above reads its fp32 tile with four-way conflicts (a column's four parts
// sit 32 rows apart: the same bank) and stores it with two-way ones.
constexpr int kColThreads = 256;
__global__ void __launch_bounds__(kColThreads)
    quantize_1x128_columns_tiled_kernel(const bf* __restrict__ x, int64_t rows, int64_t cols,
                                        int64_t ld, bool pow2, uint8_t* __restrict__ q,
                                        float* __restrict__ scale_inv) {
    __shared__ uint4 tile[kBlock][kColTile / 8];  // bf16 rows of the tile
    __shared__ float part_max[4][kColTile];
    const int64_t r0 = int64_t(blockIdx.x) * kBlock, c0 = int64_t(blockIdx.y) * kColTile;
    constexpr int kLoads = kBlock * kColTile / 8 / kColThreads;  // 16-byte loads per thread
    uint4 raw[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
        const int i = threadIdx.x + j * kColThreads, r = i / (kColTile / 8),
                  c = i % (kColTile / 8) * 8;
        raw[j] = r0 + r < rows && c0 + c < cols
                     ? *reinterpret_cast<const uint4*>(x + (r0 + r) * ld + c0 + c)
                     : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
        const int i = threadIdx.x + j * kColThreads;
        tile[i / (kColTile / 8)][i % (kColTile / 8)] = raw[j];
    }
    __syncthreads();
    const int c = threadIdx.x % kColTile, quarter = threadIdx.x / kColTile;
    const bf* column = reinterpret_cast<const bf*>(&tile[0][0]) + c;
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 32; ++k)
        amax = fmaxf(amax, fabsf(__bfloat162float(column[(quarter * 32 + k) * kColTile])));
    part_max[quarter][c] = amax;
    __syncthreads();
    amax = fmaxf(fmaxf(part_max[0][c], part_max[1][c]), fmaxf(part_max[2][c], part_max[3][c]));
    const float s = scale_from_amax(amax, pow2);
    const int64_t col = c0 + c, row = r0 + quarter * 32;
    if (col >= cols || row >= rows) return;  // rows % 32 == 0: a quarter is all in or all out
    uint32_t word[8];  // the column read again (conflict-free) rather than held: fewer registers
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        uint8_t b[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            b[j] = to_e4m3(__bfloat162float(column[(quarter * 32 + 4 * k + j) * kColTile]) * s);
        word[k] = pack4(b);
    }
    uint4* dst = reinterpret_cast<uint4*>(q + col * rows + row);
    dst[0] = make_uint4(word[0], word[1], word[2], word[3]);
    dst[1] = make_uint4(word[4], word[5], word[6], word[7]);
    if (quarter == 0) scale_inv[fp8::scale_index_1x128(col, blockIdx.x, cols)] = __fdiv_rn(1.f, s);
}

}  // namespace

void quantize_fp8_1x128(const ExecContext& ctx, const bf16* x, int64_t rows, int64_t cols,
                        int64_t ld, bool pow2, uint8_t* q, float* scale_inv) {
    if (rows == 0 || cols == 0) return;
    const int64_t units = rows * ((cols + kBlock - 1) / kBlock);
    if (cols % 8 == 0 && ld % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(q) % 8 == 0) {
        const int64_t per_block = kWideThreads / 16 * kWideUnits;
        quantize_1x128_wide_kernel<<<unsigned((units + per_block - 1) / per_block), kWideThreads, 0,
                                     stream_of(ctx)>>>(dev(x), rows, cols, ld, pow2, q, scale_inv);
        ST_CUDA_LAUNCH_CHECK();
        return;
    }
    // Vector loads and stores need 8-byte aligned rows of x and 4-byte aligned rows of q.
    const bool vec = cols % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(q) % 4 == 0;
    quantize_1x128_kernel<<<unsigned((units + 7) / 8), 256, 0, stream_of(ctx)>>>(
        dev(x), rows, cols, ld, pow2, vec, q, scale_inv);
    ST_CUDA_LAUNCH_CHECK();
}

void quantize_fp8_128x128(const ExecContext& ctx, const float* w, int64_t rows, int64_t cols,
                          bool pow2, uint8_t* q, float* scale_inv, bool transposed) {
    if (rows == 0 || cols == 0) return;
    const int64_t rb = (rows + kBlock - 1) / kBlock, cb = (cols + kBlock - 1) / kBlock;
    quantize_128x128_kernel<<<dim3(unsigned(rb), unsigned(cb)), 256, 0, stream_of(ctx)>>>(
        w, rows, cols, pow2, transposed, q, scale_inv);
    ST_CUDA_LAUNCH_CHECK();
}

void quantize_fp8_128x128_both(const ExecContext& ctx, const float* w, int64_t rows, int64_t cols,
                               bool pow2, uint8_t* q, float* scale_inv, uint8_t* qt,
                               float* scale_inv_t, int64_t count, int64_t w_stride) {
    if (rows == 0 || cols == 0 || count == 0) return;
    const int64_t rb = (rows + kBlock - 1) / kBlock, cb = (cols + kBlock - 1) / kBlock;
    // Every matrix of a batch keeps the alignment of the first: rows x cols is a multiple of
    // 32 x 4 = 128 bytes of codes, and the masters' stride a multiple of four floats.
    if (rows % 32 == 0 && cols % 4 == 0 && w_stride % 4 == 0 &&
        reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0 &&
        reinterpret_cast<uintptr_t>(qt) % 16 == 0) {
        ST_CHECK(count <= 65535, "quantize_fp8_128x128_both: ", count,
                 " matrices in one batch (a grid's z holds 65535)");
        allow_dynamic_smem<quantize_128x128_both_tiled_kernel>(kTiledSmem);
        quantize_128x128_both_tiled_kernel<<<dim3(unsigned(rb), unsigned(cb), unsigned(count)),
                                             kTiledThreads, kTiledSmem, stream_of(ctx)>>>(
            w, rows, cols, pow2, q, scale_inv, qt, scale_inv_t, w_stride);
        ST_CUDA_LAUNCH_CHECK();
        return;
    }
    if (count > 1) {  // the untiled form one matrix at a time
        const int64_t scales = fp8::scales_128x128(rows, cols),
                      scales_t = fp8::scales_128x128(cols, rows);
        for (int64_t m = 0; m < count; ++m)
            quantize_fp8_128x128_both(ctx, w + m * w_stride, rows, cols, pow2, q + m * rows * cols,
                                      scale_inv + m * scales, qt + m * rows * cols,
                                      scale_inv_t + m * scales_t);
        return;
    }
    allow_dynamic_smem<quantize_128x128_both_kernel>(kBothSmem);
    const bool vec = rows % 4 == 0 && cols % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(q) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(qt) % 4 == 0;
    quantize_128x128_both_kernel<<<dim3(unsigned(rb), unsigned(cb)), 512, kBothSmem,
                                   stream_of(ctx)>>>(w, rows, cols, pow2, vec, q, scale_inv, qt,
                                                     scale_inv_t);
    ST_CUDA_LAUNCH_CHECK();
}

void quantize_fp8_1x128_columns(const ExecContext& ctx, const bf16* x, int64_t rows, int64_t cols,
                                int64_t ld, bool pow2, uint8_t* q, float* scale_inv) {
    if (rows == 0 || cols == 0) return;
    const int64_t rb = (rows + kBlock - 1) / kBlock, cb = (cols + kColTile - 1) / kColTile;
    const bool vec = cols % 8 == 0 && ld % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    if (vec && rows % 32 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0) {
        quantize_1x128_columns_tiled_kernel<<<dim3(unsigned(rb), unsigned(cb)), kColThreads, 0,
                                              stream_of(ctx)>>>(dev(x), rows, cols, ld, pow2, q,
                                                                scale_inv);
        ST_CUDA_LAUNCH_CHECK();
        return;
    }
    quantize_1x128_columns_kernel<<<dim3(unsigned(rb), unsigned(cb)), 256, 0, stream_of(ctx)>>>(
        dev(x), rows, cols, ld, pow2, vec, q, scale_inv);
    ST_CUDA_LAUNCH_CHECK();
}

void quantize_fp8_1x128_expert_columns(const ExecContext& ctx, const bf16* x,
                                       const int32_t* offsets, int64_t experts, int64_t cols,
                                       int64_t ld, int64_t padded, bool pow2, uint8_t* q,
                                       float* scale_inv) {
    ST_CHECK(padded % kBlock == 0, "quantize_fp8_1x128_expert_columns: the padded row count (",
             padded, ") must be a multiple of 128");
    if (padded == 0 || cols == 0 || experts == 0) return;
    const int64_t cb = (cols + kColTile - 1) / kColTile;
    quantize_1x128_expert_columns_kernel<<<dim3(unsigned(padded / kBlock), unsigned(cb)), 256, 0,
                                           stream_of(ctx)>>>(dev(x), offsets, experts, cols, ld,
                                                             padded, pow2, q, scale_inv);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
