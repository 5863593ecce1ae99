// The fused masked-attention kernels' row write-out (masked_probs_wgmma.cu: P,
// masked_dscores_wgmma.cu: dS): a block holds 64-ish query rows of one head and walks their key
// tiles; each tile's bf16 rows are staged in shared memory and leave as 16-byte pieces of whole
// rows, and the keys past the last live tile (causally empty) are written as zeros.
// Output layout: row (q * heads + h) of [chunk rows, heads, lds] bf16.
#pragma once

#include <cstdint>

#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda::masked_rows {

// A tile's kRows staged rows of kKeys bf16 (row r at stage + r * kLd bytes) to keys k0 .. of rows
// q0 + r, by kThreads threads (kKeys / 8 pieces per row; rows past n and keys past lds are not
// written). The caller has synchronized the block since the staging writes.
template <int kRows, int kKeys, int kLd, int kThreads>
__device__ __forceinline__ void write_tile(bf* out, const unsigned char* stage, int64_t q0,
                                           int64_t n, int64_t heads, int64_t h, int64_t lds,
                                           int64_t k0, int tid) {
    constexpr int kPieces = kKeys / 8, kRowsPerPass = kThreads / kPieces;
    static_assert(kThreads % kPieces == 0 && kRows % kRowsPerPass == 0, "whole passes");
    const int piece = tid % kPieces;
    const int64_t key = k0 + 8 * piece;
#pragma unroll
    for (int it = 0; it < kRows / kRowsPerPass; ++it) {
        const int r = tid / kPieces + kRowsPerPass * it;
        const int64_t q = q0 + r;
        if (q < n && key < lds)
            *reinterpret_cast<uint4*>(out + (q * heads + h) * lds + key) =
                *reinterpret_cast<const uint4*>(stage + r * kLd + piece * 16);
    }
}

// Zeros at keys z0 .. lds - 1 of rows q0 .. q0 + kRows - 1 (those below n), 8 per 16-byte store:
// the causally empty key tiles (lds is a multiple of 8, z0 of the tile width).
template <int kRows, int kThreads>
__device__ __forceinline__ void zero_tails(bf* out, int64_t q0, int64_t n, int64_t heads, int64_t h,
                                           int64_t lds, int64_t z0, int tid) {
    const int64_t zvecs = (lds - min(lds, z0)) / 8;
    for (int64_t i = tid; i < kRows * zvecs; i += kThreads) {
        const int64_t q = q0 + i / zvecs;
        if (q < n)
            *reinterpret_cast<uint4*>(out + (q * heads + h) * lds + z0 + (i % zvecs) * 8) =
                make_uint4(0u, 0u, 0u, 0u);
    }
}

}  // namespace sparsetron::cuda::masked_rows
