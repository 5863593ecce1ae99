// The end-to-end TV loss of repeated MTP (SPEC §5) on the device: softmax of head logits, the
// per-row overlap α = Σ min(p, q), the chain loss with its ∂L/∂α, and the logit gradient.
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/loss/loss.h"

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

// W consecutive floats of a row as one access (W = 4: 16 bytes; rows and vocab 16-byte aligned).
template <int W>
__device__ __forceinline__ void load_row(const float* at, float* out) {
    if constexpr (W == 4) {
        const float4 x = *reinterpret_cast<const float4*>(at);
        out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
    } else {
        out[0] = *at;
    }
}
template <int W>
__device__ __forceinline__ void store_row(float* at, const float* in) {
    if constexpr (W == 4)
        *reinterpret_cast<float4*>(at) = make_float4(in[0], in[1], in[2], in[3]);
    else
        *at = in[0];
}

// One draft row per block: softmax of the logits in place (online max/sum in the first sweep)
// and, in the normalising sweep, the overlap with the target row, α = Σ min(p, q), and the
// gradient's sum s = Σ_{q<=p} q. The separate overlap pass and the gradient kernel's own sum
// sweep each re-read both rows (0.62 MB each at the proxy's vocabulary); here q is read twice
// and p once.
template <int W>
__global__ void draft_softmax_overlap_kernel(const float* p, float* q, int64_t vocab, float* alpha,
                                             float* below) {
    const int64_t r = blockIdx.x;
    const float* pr = p + r * vocab;
    float* qr = q + r * vocab;
    float mx = -INFINITY, l = 0.f;
    for (int64_t v = int64_t(threadIdx.x) * W; v < vocab; v += int64_t(blockDim.x) * W) {
        float x[W];
        load_row<W>(qr + v, x);
        float m = x[0];
#pragma unroll
        for (int j = 1; j < W; ++j) m = fmaxf(m, x[j]);
        if (m > mx) {
            l *= __expf(mx - m);
            mx = m;
        }
#pragma unroll
        for (int j = 0; j < W; ++j) l += __expf(x[j] - mx);
    }
    const float m = block_max(mx);
    const float inv = 1.f / block_sum(mx == -INFINITY ? 0.f : l * __expf(mx - m));
    float a = 0.f, s = 0.f;
    for (int64_t v = int64_t(threadIdx.x) * W; v < vocab; v += int64_t(blockDim.x) * W) {
        float x[W], t[W];
        load_row<W>(qr + v, x);
        load_row<W>(pr + v, t);
#pragma unroll
        for (int j = 0; j < W; ++j) {
            x[j] = __expf(x[j] - m) * inv;
            a += fminf(x[j], t[j]);
            s += x[j] <= t[j] ? x[j] : 0.f;
        }
        store_row<W>(qr + v, x);
    }
    a = block_sum(a);
    s = block_sum(s);
    if (threadIdx.x == 0) alpha[r] = a, below[r] = s;
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

// dz = -dα q (s - 1 + 1[q > p]) with s from the overlap kernel: p and q read once.
template <int W>
__global__ void tv_grad_kernel(const float* p, const float* q, const float* dalpha,
                               const float* below, int64_t vocab, bf* dz) {
    const int64_t r = blockIdx.x;
    const float da = dalpha[r], s1 = below[r] - 1.f;
    const float *pr = p + r * vocab, *qr = q + r * vocab;
    bf* dr = dz + r * vocab;
    for (int64_t v = int64_t(threadIdx.x) * W; v < vocab; v += int64_t(blockDim.x) * W) {
        float x[W], t[W];
        load_row<W>(qr + v, x);
        load_row<W>(pr + v, t);
#pragma unroll
        for (int j = 0; j < W; ++j) x[j] = -da * x[j] * (s1 + (x[j] > t[j] ? 1.f : 0.f));
        if constexpr (W == 4) {
            const __nv_bfloat162 lo = __floats2bfloat162_rn(x[0], x[1]),
                                 hi = __floats2bfloat162_rn(x[2], x[3]);
            uint2 packed;
            packed.x = *reinterpret_cast<const uint32_t*>(&lo);
            packed.y = *reinterpret_cast<const uint32_t*>(&hi);
            *reinterpret_cast<uint2*>(dr + v) = packed;
        } else {
            dr[v] = __float2bfloat16(x[0]);
        }
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

// 16-byte rows when the vocabulary and every row start allow it.
static bool rows_vectorizable(int64_t vocab, const void* a, const void* b) {
    return vocab % 4 == 0 && aligned16(a, b);
}

void tv_draft_softmax_overlap(const ExecContext& ctx, const float* p, float* q, int64_t rows,
                              int64_t vocab, float* alpha, float* below) {
    if (rows == 0) return;
    if (rows_vectorizable(vocab, p, q))
        draft_softmax_overlap_kernel<4>
            <<<rows, kThreads, 0, stream_of(ctx)>>>(p, q, vocab, alpha, below);
    else
        draft_softmax_overlap_kernel<1>
            <<<rows, kThreads, 0, stream_of(ctx)>>>(p, q, vocab, alpha, below);
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
                   const float* below, int64_t rows, int64_t vocab, bf16* dz_out) {
    if (rows == 0) return;
    // The bf16 output takes 8-byte stores: its rows are aligned when the float rows are.
    if (rows_vectorizable(vocab, p, q) && reinterpret_cast<uintptr_t>(dz_out) % 8 == 0)
        tv_grad_kernel<4>
            <<<rows, kThreads, 0, stream_of(ctx)>>>(p, q, dalpha, below, vocab, dev(dz_out));
    else
        tv_grad_kernel<1>
            <<<rows, kThreads, 0, stream_of(ctx)>>>(p, q, dalpha, below, vocab, dev(dz_out));
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
