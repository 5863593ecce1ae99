// Copies and conversions: strided 2-d copies, zeroing, host <-> device transfers, fp32 <-> bf16,
// and the context-parallel row moves between a rank's rows and the micro-batch's key rows.
// CPU: convert_cpu.cpp (the Tensor conversion); CUDA: copy.cu, convert.cu, cp_rows.cu. Tests:
// tests/ops/copy/test_copy_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/core/tensor.h"

namespace sparsetron::ops {

// Element-type conversion between fp32 and bf16 (round-to-nearest-even) on the tensors' device.
void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst);

}  // namespace sparsetron::ops

namespace sparsetron::cuda {

// rows x width_bytes from src (pitch in bytes) to dst (pitch in bytes), on the stream.
void copy_2d(const ExecContext& ctx, void* dst, int64_t dst_pitch, const void* src,
             int64_t src_pitch, int64_t width_bytes, int64_t rows);
void zero(const ExecContext& ctx, void* dst, int64_t bytes);
// Host -> device on the stream (the host buffer may be reused when this returns) and device ->
// host followed by a stream synchronization.
void upload(const ExecContext& ctx, void* dst, const void* src, int64_t bytes);
void download(const ExecContext& ctx, void* dst, const void* src, int64_t bytes);
// Waits until the stream's work is done.
void synchronize(const ExecContext& ctx);
// Slot copies through a device index, so one captured launch serves whichever slot the step is
// at: dst <- slots + *slot x bytes, slots + *slot x bytes <- src (`bytes` a multiple of 4; a
// slot starts on a 4-byte boundary), and *counter += 1.
void copy_from_slot(const ExecContext& ctx, void* dst, const void* slots, int64_t bytes,
                    const int32_t* slot);
void copy_to_slot(const ExecContext& ctx, void* slots, const void* src, int64_t bytes,
                  const int32_t* slot);
void increment(const ExecContext& ctx, int32_t* counter);
// dst[r, c] (+)= src[r, c] for a rows x cols block with leading dimensions, fp32 -> bf16.
void f32_to_bf16_2d(const ExecContext& ctx, const float* src, int64_t ld_src, bf16* dst,
                    int64_t ld_dst, int64_t rows, int64_t cols, bool accumulate);
void bf16_to_f32(const ExecContext& ctx, const bf16* src, float* dst, int64_t n);
void f32_to_bf16(const ExecContext& ctx, const float* src, bf16* dst, int64_t n);

// Context parallelism (cp_rows.cu): key_row[i] is row i's micro-batch row (-1: padding).
// dst [keys, dim] fp32 <- zero, then row key_row[i] = src[i] (the contribution to an all-reduce).
void rows_to_keys(const ExecContext& ctx, const bf16* src, int64_t rows, int64_t dim,
                  const int32_t* key_row, float* dst, int64_t keys);
// The same in bf16: dst [keys, dim] <- zero, then row key_row[i] = src[i] (every CP rank's rows,
// all-gathered, into the micro-batch's key rows).
void rows_to_keys(const ExecContext& ctx, const bf16* src, int64_t rows, int64_t dim,
                  const int32_t* key_row, bf16* dst, int64_t keys);
// dst [rows, dim] <- src[key_row[i]] (0 for padding): this rank's rows of all-reduced key grads.
void keys_to_rows(const ExecContext& ctx, const float* src, int64_t dim, const int32_t* key_row,
                  int64_t rows, float* dst);
// dst [rows, dim] <- src[key_row[i] + shift] where that is a row of src ([keys, dim]), else 0.
void gather_key_rows(const ExecContext& ctx, const bf16* src, int64_t keys, int64_t dim,
                     const int32_t* key_row, int64_t shift, int64_t rows, bf16* dst);

// dst[i] = RNE(src[i]) for fp32 -> bf16, exact widening for bf16 -> fp32 (contiguous, same numel).
void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst);

}  // namespace sparsetron::cuda
