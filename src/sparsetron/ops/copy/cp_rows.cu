// Moving rows between context-parallel ranks' rows and the micro-batch's key rows (the CUDA side
// of model/cp_rows.h; model/cuda/cp_keys.h uses them): the CP group's all-gathered rows scattered
// to their key rows, and key-row gradients picked out in the order of the ranks that own them
// (for a reduce-scatter) or of this rank's rows.
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/copy/copy.h"

namespace sparsetron::cuda {
namespace {

__global__ void rows_to_keys_kernel(const bf* src, int64_t rows, int64_t dim,
                                    const int32_t* key_row, float* dst) {
    const int64_t i = blockIdx.y, c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int32_t r = key_row[i];
    if (r < 0 || c >= dim) return;
    dst[int64_t(r) * dim + c] = __bfloat162float(src[i * dim + c]);
}

__global__ void rows_to_keys_bf16_kernel(const bf* src, int64_t dim, const int32_t* key_row,
                                         bf* dst) {
    const int64_t i = blockIdx.y, c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int32_t r = key_row[i];
    if (r < 0 || c >= dim) return;
    dst[int64_t(r) * dim + c] = src[i * dim + c];
}

__global__ void keys_to_rows_kernel(const float* src, int64_t dim, const int32_t* key_row,
                                    float* dst) {
    const int64_t i = blockIdx.y, c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    const int32_t r = key_row[i];
    dst[i * dim + c] = r < 0 ? 0.f : src[int64_t(r) * dim + c];
}

__global__ void gather_key_rows_kernel(const bf* src, int64_t keys, int64_t dim,
                                       const int32_t* key_row, int64_t shift, bf* dst) {
    const int64_t i = blockIdx.y, c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    const int64_t r = key_row[i];
    const bool ok = r >= 0 && r + shift < keys;
    dst[i * dim + c] = ok ? src[(r + shift) * dim + c] : __float2bfloat16(0.f);
}

}  // namespace

void rows_to_keys(const ExecContext& ctx, const bf16* src, int64_t rows, int64_t dim,
                  const int32_t* key_row, float* dst, int64_t keys) {
    zero(ctx, dst, keys * dim * int64_t(sizeof(float)));
    if (rows == 0) return;
    rows_to_keys_kernel<<<dim3(blocks_for(dim, 128), unsigned(rows)), 128, 0, stream_of(ctx)>>>(
        dev(src), rows, dim, key_row, dst);
    ST_CUDA_LAUNCH_CHECK();
}

void rows_to_keys(const ExecContext& ctx, const bf16* src, int64_t rows, int64_t dim,
                  const int32_t* key_row, bf16* dst, int64_t keys) {
    zero(ctx, dst, keys * dim * int64_t(sizeof(bf16)));
    if (rows == 0) return;
    rows_to_keys_bf16_kernel<<<dim3(blocks_for(dim, 128), unsigned(rows)), 128, 0,
                               stream_of(ctx)>>>(dev(src), dim, key_row, dev(dst));
    ST_CUDA_LAUNCH_CHECK();
}

void keys_to_rows(const ExecContext& ctx, const float* src, int64_t dim, const int32_t* key_row,
                  int64_t rows, float* dst) {
    if (rows == 0) return;
    keys_to_rows_kernel<<<dim3(blocks_for(dim, 128), unsigned(rows)), 128, 0, stream_of(ctx)>>>(
        src, dim, key_row, dst);
    ST_CUDA_LAUNCH_CHECK();
}

void gather_key_rows(const ExecContext& ctx, const bf16* src, int64_t keys, int64_t dim,
                     const int32_t* key_row, int64_t shift, int64_t rows, bf16* dst) {
    if (rows == 0) return;
    gather_key_rows_kernel<<<dim3(blocks_for(dim, 128), unsigned(rows)), 128, 0, stream_of(ctx)>>>(
        dev(src), keys, dim, key_row, shift, dev(dst));
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
