// Copies and dtype conversions on the stream (copy.h): the pieces of a layout change inside a
// layer.
#include <algorithm>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/copy/copy.h"

namespace sparsetron::cuda {
namespace {

__global__ void f32_to_bf16_2d_kernel(const float* src, int64_t ld_src, bf* dst, int64_t ld_dst,
                                      int64_t rows, int64_t cols, bool accumulate) {
    const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (id >= rows * cols) return;
    const int64_t r = id / cols, c = id % cols;
    bf* d = dst + r * ld_dst + c;
    const float v = src[r * ld_src + c];
    *d = __float2bfloat16(accumulate ? __bfloat162float(*d) + v : v);
}

__global__ void bf16_to_f32_kernel(const bf* src, float* dst, int64_t n) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i < n) dst[i] = __bfloat162float(src[i]);
}

__global__ void f32_to_bf16_kernel(const float* src, bf* dst, int64_t n) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i < n) dst[i] = __float2bfloat16(src[i]);
}

// dst[i] = src[i] over `words` 4-byte words, one of the two offset by *slot x words.
__global__ void slot_copy_kernel(uint32_t* dst, const uint32_t* src, int64_t words,
                                 const int32_t* slot, bool slot_in_src) {
    const int64_t shift = int64_t(*slot) * words;
    const uint32_t* s = slot_in_src ? src + shift : src;
    uint32_t* d = slot_in_src ? dst : dst + shift;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words;
         i += int64_t(gridDim.x) * blockDim.x)
        d[i] = s[i];
}

__global__ void increment_kernel(int32_t* counter) {
    *counter += 1;
}

void slot_copy(const ExecContext& ctx, void* dst, const void* src, int64_t bytes,
               const int32_t* slot, bool slot_in_src) {
    ST_CHECK(bytes % 4 == 0, "slot copies move 4-byte words; ", bytes, " bytes");
    const int64_t words = bytes / 4;
    if (words == 0) return;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((words + threads - 1) / threads, 4 * sm_count());
    slot_copy_kernel<<<unsigned(blocks), threads, 0, stream_of(ctx)>>>(
        static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), words, slot, slot_in_src);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace

void copy_from_slot(const ExecContext& ctx, void* dst, const void* slots, int64_t bytes,
                    const int32_t* slot) {
    slot_copy(ctx, dst, slots, bytes, slot, true);
}

void copy_to_slot(const ExecContext& ctx, void* slots, const void* src, int64_t bytes,
                  const int32_t* slot) {
    slot_copy(ctx, slots, src, bytes, slot, false);
}

void increment(const ExecContext& ctx, int32_t* counter) {
    increment_kernel<<<1, 1, 0, stream_of(ctx)>>>(counter);
    ST_CUDA_LAUNCH_CHECK();
}

void copy_2d(const ExecContext& ctx, void* dst, int64_t dst_pitch, const void* src,
             int64_t src_pitch, int64_t width_bytes, int64_t rows) {
    if (rows == 0 || width_bytes == 0) return;
    ST_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width_bytes, rows,
                                    cudaMemcpyDeviceToDevice, stream_of(ctx)));
}

void zero(const ExecContext& ctx, void* dst, int64_t bytes) {
    if (bytes == 0) return;
    ST_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_of(ctx)));
}

void upload(const ExecContext& ctx, void* dst, const void* src, int64_t bytes) {
    if (bytes == 0) return;
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(ctx)));
    // Pageable sources are staged before the call returns, but make it explicit: the caller's
    // buffer is refilled for the next micro-batch right away.
    ST_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
}

void synchronize(const ExecContext& ctx) {
    ST_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
}

void download(const ExecContext& ctx, void* dst, const void* src, int64_t bytes) {
    if (bytes == 0) return;
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(ctx)));
    ST_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
}

void f32_to_bf16_2d(const ExecContext& ctx, const float* src, int64_t ld_src, bf16* dst,
                    int64_t ld_dst, int64_t rows, int64_t cols, bool accumulate) {
    const int64_t n = rows * cols;
    if (n == 0) return;
    f32_to_bf16_2d_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(
        src, ld_src, dev(dst), ld_dst, rows, cols, accumulate);
    ST_CUDA_LAUNCH_CHECK();
}

void bf16_to_f32(const ExecContext& ctx, const bf16* src, float* dst, int64_t n) {
    if (n == 0) return;
    bf16_to_f32_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(dev(src), dst, n);
    ST_CUDA_LAUNCH_CHECK();
}

void f32_to_bf16(const ExecContext& ctx, const float* src, bf16* dst, int64_t n) {
    if (n == 0) return;
    f32_to_bf16_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(src, dev(dst), n);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
