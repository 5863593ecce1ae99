// Output head fused with cross-entropy, one chunk of rows at a time: [chunk, V] fp32 logits from
// cuBLASLt, one block per row for the softmax statistics and dlogits, the input gradient per
// chunk, and the weight gradient once over all rows' dlogits.
#include <algorithm>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/loss/loss.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 512;

// Adds four values to the online statistics (one rescale at most).
__device__ __forceinline__ void online_add4(float& mx, float& l, float4 x) {
    const float m4 = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
    if (m4 > mx) {
        l = mx == -INFINITY ? 0.f : l * __expf(mx - m4);
        mx = m4;
    }
    l += __expf(x.x - mx) + __expf(x.y - mx) + __expf(x.z - mx) + __expf(x.w - mx);
}

// One block per row. Two sweeps over the row's fp32 logits (a 154880-wide row does not stay in
// cache): the max and the sum of exponentials together (online softmax), then the dlogits; the
// earlier form swept three times (max, sum, write). 16-byte loads when the row length is a
// multiple of 4 (rows are then 16-byte aligned).
__global__ void cross_entropy_rows(const float* logits, int64_t vocab, const int32_t* targets,
                                   float grad_scale_host, const float* grad_scale_dev,
                                   float* row_loss, bf* dlogits) {
    __shared__ float red_m[kThreads / 32], red_l[kThreads / 32];
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
    const bool vec = vocab % 4 == 0;
    float mx = -INFINITY, l = 0.f;
    if (vec) {
        const float4* z4 = reinterpret_cast<const float4*>(z);
        for (int64_t v = threadIdx.x; v < vocab / 4; v += blockDim.x) online_add4(mx, l, z4[v]);
    } else {
        for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) online_add(mx, l, z[c]);
    }
    for (int o = 16; o > 0; o >>= 1)
        online_merge(mx, l, __shfl_xor_sync(0xffffffffu, mx, o),
                     __shfl_xor_sync(0xffffffffu, l, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red_m[warp] = mx, red_l[warp] = l;
    __syncthreads();
    mx = -INFINITY, l = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) online_merge(mx, l, red_m[w], red_l[w]);  // fixed order
    const float lse = mx + logf(l);
    if (threadIdx.x == 0) row_loss[r] = lse - z[tgt];
    if (!dlogits) return;
    bf* dl = dlogits + r * vocab;
    if (vec) {
        const float4* z4 = reinterpret_cast<const float4*>(z);
        uint2* d4 = reinterpret_cast<uint2*>(dl);  // 8-byte aligned: rows of 4k bf16
        for (int64_t v = threadIdx.x; v < vocab / 4; v += blockDim.x) {
            const float4 x = z4[v];
            const int hit = tgt >> 2 == v ? (tgt & 3) : -1;  // the target's lane of the four
            const float p0 = __expf(x.x - lse) * grad_scale - (hit == 0 ? grad_scale : 0.f);
            const float p1 = __expf(x.y - lse) * grad_scale - (hit == 1 ? grad_scale : 0.f);
            const float p2 = __expf(x.z - lse) * grad_scale - (hit == 2 ? grad_scale : 0.f);
            const float p3 = __expf(x.w - lse) * grad_scale - (hit == 3 ? grad_scale : 0.f);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(p0, p1);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(p2, p3);
            d4[v] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                               *reinterpret_cast<const uint32_t*>(&hi));
        }
    } else {
        for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
            const float p = __expf(z[c] - lse) * grad_scale;
            st(dl + c, c == tgt ? p - grad_scale : p);
        }
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

void head_cross_entropy(const ExecContext& ctx, const HeadLoss& p, float* row_loss, bf16* dh,
                        void* dw) {
    const bf16 *h = p.h, *w = p.w;
    const int64_t rows = p.rows, dim = p.dim, vocab = p.vocab, chunk_rows = p.chunk_rows;
    const int32_t* targets = p.targets;
    float* logits_ws = p.logits_ws;
    bf16* dlogits_ws = p.dlogits_ws;
    const float grad_scale = p.grad_scale, dw_beta = p.dw_beta;
    const float* grad_scale_dev = p.grad_scale_dev;
    ST_ASSERT(chunk_rows > 0, "head_cross_entropy: chunk rows");
    const bool backward = dh || dw;
    ST_ASSERT(!backward || dlogits_ws, "head_cross_entropy: backward needs the dlogits workspace");
    // Rows whose dlogits the workspace holds at once: a whole number of chunks.
    const int64_t group = dw ? std::min(rows, p.dlogits_rows) : chunk_rows;
    ST_ASSERT(!dw || (group > 0 && (group == rows || group % chunk_rows == 0)),
              "head_cross_entropy: dlogits rows must be all rows or a multiple of chunk rows");
    const HeadFp8* f8 = p.fp8;
    // The block-scaled GEMMs contract over multiples of 16: dim (logits), the vocabulary (dh),
    // the rows of a group of dlogits (dw).
    ST_CHECK(!f8 || (dim % 16 == 0 && vocab % 16 == 0 && chunk_rows % 16 == 0 && rows % 16 == 0),
             "fp8_output_proj needs the hidden size (", dim, "), the vocabulary (", vocab,
             "), the loss chunk (", chunk_rows, ") and the micro-batch rows (", rows,
             ") in multiples of 16");
    for (int64_t g0 = 0; g0 < rows; g0 += group) {
        const int64_t g1 = std::min(rows, g0 + group);
        for (int64_t r0 = g0; r0 < g1; r0 += chunk_rows) {
            const int64_t n = std::min(chunk_rows, g1 - r0);
            // With dw, the group's chunks' dlogits stay for its weight-gradient GEMM below.
            bf16* dl = dw ? dlogits_ws + (r0 - g0) * vocab : dlogits_ws;
            if (f8) {
                quantize_fp8_1x128(ctx, h + r0 * dim, n, dim, dim, cpu::kFp8Pow2Scales, f8->qa,
                                   f8->sa);
                gemm_fp8_blockwise(ctx, n, vocab, dim, {f8->qa, f8->sa, false}, f8->w, logits_ws,
                                   vocab);
            } else {
                gemm(ctx, false, true, n, vocab, dim, 1.f, h + r0 * dim, dim, w, dim, 0.f,
                     logits_ws, vocab, DType::BF16, DType::F32);
            }
            cross_entropy_rows<<<n, kThreads, 0, stream_of(ctx)>>>(
                logits_ws, vocab, targets + r0, grad_scale, grad_scale_dev, row_loss + r0,
                backward ? dev(dl) : nullptr);
            ST_CUDA_LAUNCH_CHECK();
            if (dh && f8) {
                quantize_fp8_1x128(ctx, dl, n, vocab, vocab, cpu::kFp8Pow2Scales, f8->qa, f8->sa);
                gemm_fp8_blockwise(ctx, n, dim, vocab, {f8->qa, f8->sa, false}, f8->wt,
                                   dh + r0 * dim, dim);
            } else if (dh) {
                gemm(ctx, false, false, n, dim, vocab, 1.f, dl, vocab, w, dim, 0.f, dh + r0 * dim,
                     dim);
            }
        }
        // One pass over the fp32 [vocab, dim] gradient (3.8 GB at GLM-5's shape) per group of
        // chunks, not per chunk: the accumulation's memory traffic, not its FLOPs, is the cost.
        const float beta = g0 == 0 ? dw_beta : 1.f;
        if (dw && f8) {
            // dlogits^T and h^T quantized along the group's rows: the contraction's dimension.
            const int64_t m = g1 - g0;
            quantize_fp8_1x128_columns(ctx, dlogits_ws, m, vocab, vocab, cpu::kFp8Pow2Scales,
                                       f8->qa, f8->sa);
            quantize_fp8_1x128_columns(ctx, h + g0 * dim, m, dim, dim, cpu::kFp8Pow2Scales, f8->qb,
                                       f8->sb);
            const Fp8Operand a{f8->qa, f8->sa, false}, b{f8->qb, f8->sb, false};
            if (p.dw_type == DType::BF16)
                gemm_fp8_blockwise(ctx, vocab, dim, m, a, b, static_cast<bf16*>(dw), dim,
                                   beta != 0.f);
            else
                gemm_fp8_blockwise(ctx, vocab, dim, m, a, b, static_cast<float*>(dw), dim,
                                   beta != 0.f);
        } else if (dw) {
            gemm(ctx, true, false, vocab, dim, g1 - g0, 1.f, dlogits_ws, vocab, h + g0 * dim, dim,
                 beta, dw, dim, DType::BF16, p.dw_type);
        }
    }
}

HeadFp8Scratch head_fp8_scratch(int64_t chunk_rows, int64_t dlogits_rows, int64_t dim,
                                int64_t vocab) {
    // a: h's rows [chunk, dim] (logits), dlogits [chunk, vocab] (dh), dlogits^T [vocab, group]
    // (dw); b: h^T [dim, group] (dw).
    const int64_t c = chunk_rows, g = dlogits_rows;
    return {.qa = std::max(c, g) * std::max(dim, vocab),
            .qb = dim * g,
            .sa = std::max({fp8::scales_1x128(c, dim), fp8::scales_1x128(c, vocab),
                            fp8::scales_1x128(vocab, g)}),
            .sb = fp8::scales_1x128(dim, g)};
}

int64_t head_dlogits_rows(int64_t rows, int64_t chunk_rows, int64_t dim) {
    return std::min(rows, (dim + chunk_rows - 1) / chunk_rows * chunk_rows);
}

void loss_sum(const ExecContext& ctx, const float* row_loss, const int32_t* targets, int64_t rows,
              double* out) {
    loss_sum_kernel<<<1, 256, 0, stream_of(ctx)>>>(row_loss, targets, rows, out);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
