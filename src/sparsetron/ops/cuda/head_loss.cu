// Output head fused with cross-entropy, one chunk of rows at a time: [chunk, V] fp32 logits from
// cuBLASLt, one block per row for the softmax statistics and dlogits, the input gradient per
// chunk, and the weight gradient once over all rows' dlogits.
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/ops.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 512;

__global__ void cross_entropy_rows(const float* logits, int64_t vocab, const int32_t* targets,
                                   float grad_scale_host, const float* grad_scale_dev,
                                   float* row_loss, bf* dlogits) {
    const int64_t r = blockIdx.x;
    const float grad_scale = grad_scale_host * (grad_scale_dev ? *grad_scale_dev : 1.f);
    const float* z = logits + r * vocab;
    const int32_t tgt = targets[r];
    if (tgt < 0) {
        if (threadIdx.x == 0) row_loss[r] = 0;
        if (dlogits)
            for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x)
                st(dlogits + r * vocab + c, 0.f);
        return;
    }
    float mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) mx = fmaxf(mx, z[c]);
    mx = block_max(mx);
    float s = 0;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) s += __expf(z[c] - mx);
    const float lse = mx + logf(block_sum(s));
    if (threadIdx.x == 0) row_loss[r] = lse - z[tgt];
    if (dlogits)
        for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
            float p = __expf(z[c] - lse) * grad_scale;
            st(dlogits + r * vocab + c, c == tgt ? p - grad_scale : p);
        }
}

__global__ void loss_sum_kernel(const float* row_loss, const int32_t* targets, int64_t rows,
                                double* out) {
    // One block; per-thread partials over a strided range, then a fixed-order combine in fp64.
    __shared__ double part[256];
    __shared__ long long cnt[256];
    double s = 0;
    long long c = 0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        s += row_loss[r];
        c += targets[r] >= 0;
    }
    part[threadIdx.x] = s, cnt[threadIdx.x] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0;
        long long n = 0;
        for (int i = 0; i < int(blockDim.x); ++i) total += part[i], n += cnt[i];
        out[0] = total, out[1] = double(n);
    }
}

}  // namespace

void head_cross_entropy(const ExecContext& ctx, const bf16* h, int64_t rows, int64_t dim,
                        const bf16* w, int64_t vocab, const int32_t* targets, int64_t chunk_rows,
                        float* logits_ws, bf16* dlogits_ws, float grad_scale, float* row_loss,
                        bf16* dh, float* dw, const float* grad_scale_dev) {
    ST_ASSERT(chunk_rows > 0, "head_cross_entropy: chunk rows");
    const bool backward = dh || dw;
    ST_ASSERT(!backward || dlogits_ws, "head_cross_entropy: backward needs the dlogits workspace");
    for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
        const int64_t n = std::min(chunk_rows, rows - r0);
        // With dw, every chunk's dlogits stay for the one weight-gradient GEMM below.
        bf16* dl = dw ? dlogits_ws + r0 * vocab : dlogits_ws;
        gemm(ctx, false, true, n, vocab, dim, 1.f, h + r0 * dim, dim, w, dim, 0.f, logits_ws, vocab,
             DType::BF16, DType::F32);
        cross_entropy_rows<<<n, kThreads, 0, stream_of(ctx)>>>(
            logits_ws, vocab, targets + r0, grad_scale, grad_scale_dev, row_loss + r0,
            backward ? dev(dl) : nullptr);
        ST_CUDA_LAUNCH_CHECK();
        if (dh)
            gemm(ctx, false, false, n, dim, vocab, 1.f, dl, vocab, w, dim, 0.f, dh + r0 * dim, dim);
    }
    // One pass over the fp32 [vocab, dim] gradient (3.8 GB at GLM-5's shape) instead of one per
    // chunk: the accumulation's memory traffic, not its FLOPs, was the cost.
    if (dw)
        gemm(ctx, true, false, vocab, dim, rows, 1.f, dlogits_ws, vocab, h, dim, 1.f, dw, dim,
             DType::BF16, DType::F32);
}

void loss_sum(const ExecContext& ctx, const float* row_loss, const int32_t* targets, int64_t rows,
              double* out) {
    loss_sum_kernel<<<1, 256, 0, stream_of(ctx)>>>(row_loss, targets, rows, out);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
