// The end-to-end TV loss of repeated MTP (SPEC §5) on the device: softmax of head logits, the
// per-row overlap α = Σ min(p, q), the chain loss with its ∂L/∂α, and the logit gradient.
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/ops.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxDepth = 16;

__global__ void softmax_rows_kernel(float* z, int64_t vocab) {
    float* row = z + blockIdx.x * vocab;
    float mx = -INFINITY;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) mx = fmaxf(mx, row[v]);
    mx = block_max(mx);
    float s = 0;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) s += __expf(row[v] - mx);
    const float inv = 1.f / block_sum(s);
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) row[v] = __expf(row[v] - mx) * inv;
}

// The same with the max and the sum in one online sweep and 16-byte accesses (vocab % 4 == 0,
// aligned rows): the row (620 KB at the proxy's vocabulary) is read twice, not three times.
__global__ void softmax_rows_vec_kernel(float4* z, int64_t vocab4) {
    float4* row = z + blockIdx.x * vocab4;
    float mx = -INFINITY, l = 0.f;
    for (int64_t v = threadIdx.x; v < vocab4; v += blockDim.x) {
        const float4 x = row[v];
        const float m4 = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
        if (m4 > mx) {
            l *= __expf(mx - m4);
            mx = m4;
        }
        l += __expf(x.x - mx) + __expf(x.y - mx) + __expf(x.z - mx) + __expf(x.w - mx);
    }
    const float m = block_max(mx);
    const float inv = 1.f / block_sum(mx == -INFINITY ? 0.f : l * __expf(mx - m));
    for (int64_t v = threadIdx.x; v < vocab4; v += blockDim.x) {
        float4 x = row[v];
        x.x = __expf(x.x - m) * inv, x.y = __expf(x.y - m) * inv;
        x.z = __expf(x.z - m) * inv, x.w = __expf(x.w - m) * inv;
        row[v] = x;
    }
}

__global__ void overlap_kernel(const float* p, const float* q, int64_t vocab, float* alpha) {
    const int64_t r = blockIdx.x;
    float s = 0;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
        s += fminf(p[r * vocab + v], q[r * vocab + v]);
    s = block_sum(s);
    if (threadIdx.x == 0) alpha[r] = s;
}

__global__ void chain_kernel(const float* alpha, const uint8_t* valid, int64_t D, int64_t tokens,
                             int64_t stride, float row_weight_host, const float* row_weight_dev,
                             float* dalpha, double* sums) {
    const float row_weight = row_weight_host * (row_weight_dev ? *row_weight_dev : 1.f);
    // One block: threads over rows, then a fixed-order combine of the sums.
    __shared__ double part_loss[256], part_acc[256];
    double loss = 0, acc = 0;
    for (int64_t i = threadIdx.x; i < tokens; i += blockDim.x) {
        if (!valid[i]) {
            for (int64_t k = 0; k < D; ++k) dalpha[k * stride + i] = 0.f;
            continue;
        }
        double prefix[kMaxDepth + 1];
        prefix[0] = 1;
        for (int64_t k = 0; k < D; ++k) {
            prefix[k + 1] = prefix[k] * alpha[k * stride + i];
            loss += (1.0 - prefix[k + 1]) / double(D);
            acc += prefix[k + 1];
        }
        // ∂L/∂α_d = -(1/D) Π_{i<d} α_i (1 + Σ_{j>d} Π_{d<i<=j} α_i).
        for (int64_t d = 0; d < D; ++d) {
            double tail = 1, run = 1;
            for (int64_t j = d + 1; j < D; ++j) {
                run *= alpha[j * stride + i];
                tail += run;
            }
            dalpha[d * stride + i] = float(-prefix[d] * tail / double(D) * row_weight);
        }
    }
    part_loss[threadIdx.x] = loss, part_acc[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double l = 0, a = 0;
        for (int i = 0; i < int(blockDim.x); ++i) l += part_loss[i], a += part_acc[i];
        sums[0] += l, sums[1] += a;
    }
}

__global__ void tv_grad_kernel(const float* p, const float* q, const float* dalpha, int64_t vocab,
                               bf* dz) {
    const int64_t r = blockIdx.x;
    const float da = dalpha[r];
    const float *pr = p + r * vocab, *qr = q + r * vocab;
    float s = 0;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
        if (qr[v] <= pr[v]) s += qr[v];
    s = block_sum(s);
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
        const float dtv = qr[v] * (s - 1.f + (qr[v] > pr[v] ? 1.f : 0.f));
        dz[r * vocab + v] = __float2bfloat16(-da * dtv);
    }
}

}  // namespace

void softmax_rows(const ExecContext& ctx, float* z, int64_t rows, int64_t vocab) {
    if (rows == 0) return;
    if (vocab % 4 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0)
        softmax_rows_vec_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(reinterpret_cast<float4*>(z),
                                                                       vocab / 4);
    else
        softmax_rows_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(z, vocab);
    ST_CUDA_LAUNCH_CHECK();
}

void tv_overlap(const ExecContext& ctx, const float* p, const float* q, int64_t rows, int64_t vocab,
                float* alpha) {
    if (rows == 0) return;
    overlap_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(p, q, vocab, alpha);
    ST_CUDA_LAUNCH_CHECK();
}

void tv_chain(const ExecContext& ctx, const float* alpha, const uint8_t* valid, int64_t depths,
              int64_t rows, int64_t stride, float row_weight, float* dalpha, double* sums,
              const float* row_weight_dev) {
    ST_CHECK(depths <= kMaxDepth, "e2e_tv: at most ", kMaxDepth, " MTP depths on CUDA");
    chain_kernel<<<1, 256, 0, stream_of(ctx)>>>(alpha, valid, depths, rows, stride, row_weight,
                                                row_weight_dev, dalpha, sums);
    ST_CUDA_LAUNCH_CHECK();
}

void tv_logit_grad(const ExecContext& ctx, const float* p, const float* q, const float* dalpha,
                   int64_t rows, int64_t vocab, bf16* dz_out) {
    if (rows == 0) return;
    tv_grad_kernel<<<rows, kThreads, 0, stream_of(ctx)>>>(p, q, dalpha, vocab, dev(dz_out));
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
