// The MoE sequence aux loss on the device (sequence_aux.h): per-document statistics in blocks of
// rows added in fixed point (deterministic), the loss in one block, the gradient a warp per row.
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/moe/sequence_aux.h"

namespace sparsetron::cuda {

namespace {

constexpr int kRowsPerBlock = 64;
constexpr int kMaxTopk = 16;
// Fixed point of psum's partial sums: each term is at most 1 and a document has fewer than 2^22
// rows, so sums stay below 2^62.
constexpr double kFixed = 1099511627776.0;  // 2^40

// The document holding row t (doc_rows ascending), or -1 for a row outside every document.
__device__ int64_t document_of(const int32_t* doc_rows, int64_t docs, int64_t t) {
    if (docs == 0 || t < doc_rows[0] || t >= doc_rows[docs]) return -1;
    int64_t lo = 0, hi = docs;  // doc_rows[lo] <= t < doc_rows[hi]
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        (doc_rows[mid] <= t ? lo : hi) = mid;
    }
    return lo;
}

// Block b: rows [b R, (b + 1) R); thread x walks its experts over the rows in order, adding each
// document's partial count and score sum to `work` (counts, then psum in fixed point) when the
// document ends inside the block or the block ends.
__global__ void balance_kernel(const float* probs, const int32_t* topk, const int32_t* doc_rows,
                               int64_t tokens, int64_t docs, int64_t E, int64_t k,
                               unsigned long long* work) {
    __shared__ float rz[kRowsPerBlock];
    __shared__ int64_t doc[kRowsPerBlock];
    __shared__ int32_t chosen[kRowsPerBlock * kMaxTopk];
    const int64_t t0 = int64_t(blockIdx.x) * kRowsPerBlock;
    const int rows = int(tokens - t0 < kRowsPerBlock ? tokens - t0 : kRowsPerBlock);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int r = warp; r < rows; r += warps) {
        const float* s = probs + (t0 + r) * E;
        float z = 0.f;
        for (int64_t x = lane; x < E; x += 32) z += s[x];
        z = warp_sum(z);
        if (lane == 0) rz[r] = 1.f / z, doc[r] = document_of(doc_rows, docs, t0 + r);
    }
    for (int i = threadIdx.x; i < rows * k; i += blockDim.x) chosen[i] = topk[t0 * k + i];
    __syncthreads();
    unsigned long long* counts = work;
    unsigned long long* psum = work + docs * E;
    for (int64_t x = threadIdx.x; x < E; x += blockDim.x) {
        int64_t d = -1;
        double p = 0;
        unsigned long long c = 0;
        for (int r = 0; r <= rows; ++r) {
            const int64_t dr = r < rows ? doc[r] : -1;
            if (dr != d) {
                if (d >= 0) {
                    if (c) atomicAdd(counts + d * E + x, c);
                    atomicAdd(psum + d * E + x, (unsigned long long)(llrint(p * kFixed)));
                }
                d = dr, p = 0, c = 0;
            }
            if (d < 0) continue;
            p += double(probs[(t0 + r) * E + x]) * double(rz[r]);
            for (int64_t j = 0; j < k; ++j) c += chosen[r * k + j] == x;
        }
    }
}

__global__ void balance_finish_kernel(const unsigned long long* work, int64_t n, float* counts,
                                      float* psum) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    counts[i] = float(work[i]);
    psum[i] = float(double(work[n + i]) / kFixed);
}

__global__ void aux_loss_kernel(const float* counts, const float* psum, const float* fscale,
                                const float* w, int64_t docs, int64_t E, float* f, double* loss) {
    __shared__ double part[256];
    double acc = 0;
    for (int64_t i = threadIdx.x; i < docs * E; i += blockDim.x) {
        const int64_t d = i / E;
        const float fi = counts[i] * fscale[d];
        f[i] = fi;
        acc += double(w[d]) * double(fi) * double(psum[i]);
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if (int(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0 && loss) *loss += part[0];
}

// A warp per row: z = Σ s, fz = Σ f s, then every expert's logit gradient.
__global__ void aux_backward_kernel(const float* probs, const int32_t* doc_rows, int64_t tokens,
                                    int64_t docs, int64_t E, const float* f, const float* w,
                                    float* dlogits) {
    const int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (t >= tokens) return;
    const int64_t d = document_of(doc_rows, docs, t);
    if (d < 0) return;
    const float* s = probs + t * E;
    const float* fd = f + d * E;
    float z = 0.f, fz = 0.f;
    for (int64_t x = lane; x < E; x += 32) z += s[x], fz += fd[x] * s[x];
    z = warp_sum(z), fz = warp_sum(fz);
    const float wd = w[d];
    for (int64_t y = lane; y < E; y += 32)
        dlogits[t * E + y] += wd * (fd[y] - fz / z) / z * s[y] * (1.f - s[y]);
}

}  // namespace

void sequence_balance(const ExecContext& ctx, const float* probs, const int32_t* topk,
                      const int32_t* doc_rows, int64_t tokens, int64_t docs, int64_t experts,
                      int64_t k, int64_t* work, float* counts, float* psum) {
    ST_CHECK(k <= kMaxTopk, "sequence_balance: top-", k, " (at most ", kMaxTopk, ")");
    const int64_t n = docs * experts;
    if (n == 0) return;
    cudaStream_t s = stream_of(ctx);
    ST_CUDA_CHECK(cudaMemsetAsync(work, 0, size_t(2 * n) * sizeof(int64_t), s));
    auto* acc = reinterpret_cast<unsigned long long*>(work);
    if (tokens > 0)
        balance_kernel<<<blocks_for(tokens, kRowsPerBlock), 256, 0, s>>>(
            probs, topk, doc_rows, tokens, docs, experts, k, acc);
    balance_finish_kernel<<<blocks_for(n, 256), 256, 0, s>>>(acc, n, counts, psum);
    ST_CUDA_LAUNCH_CHECK();
}

void sequence_aux_loss(const ExecContext& ctx, const float* counts, const float* psum,
                       const float* fscale, const float* w, int64_t docs, int64_t experts, float* f,
                       double* loss) {
    if (docs * experts == 0) return;
    aux_loss_kernel<<<1, 256, 0, stream_of(ctx)>>>(counts, psum, fscale, w, docs, experts, f, loss);
    ST_CUDA_LAUNCH_CHECK();
}

void sequence_aux_backward(const ExecContext& ctx, const float* probs, const int32_t* doc_rows,
                           int64_t tokens, int64_t docs, int64_t experts, const float* f,
                           const float* w, float* dlogits) {
    if (tokens == 0 || docs == 0) return;
    aux_backward_kernel<<<blocks_for(tokens * 32, 256), 256, 0, stream_of(ctx)>>>(
        probs, doc_rows, tokens, docs, experts, f, w, dlogits);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
