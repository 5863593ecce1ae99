// MLA's expanded attention form (attention.h, MLA helpers): the per-head keys built from the
// kv_b output and the shared RoPE key, and their gradients back to those two.
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda {
namespace {

__global__ void expanded_kv_grad_kernel(const float* dk, const float* dv, int64_t heads, int64_t dn,
                                        int64_t dr, int64_t dvh, bf* dkv, bf* dpe, int64_t ld_pe) {
    const int64_t t = blockIdx.x;
    const int64_t dq = dn + dr, w = dn + dvh;
    for (int64_t i = threadIdx.x; i < heads * w; i += blockDim.x) {
        const int64_t h = i / w, c = i % w;
        const float v = c < dn ? dk[(t * heads + h) * dq + c] : dv[(t * heads + h) * dvh + c - dn];
        dkv[t * heads * w + i] = __float2bfloat16(v);
    }
    for (int64_t i = threadIdx.x; i < dr; i += blockDim.x) {
        float s = 0;
        for (int64_t h = 0; h < heads; ++h) s += dk[(t * heads + h) * dq + dn + i];
        dpe[t * ld_pe + i] = __float2bfloat16(s);
    }
}

// The same by 4-element groups (dn, dr and dvh multiples of 4: a group never straddles dk / dv):
// 16-byte loads, 8-byte stores and one index division per group instead of per element.
__global__ void expanded_kv_grad_vec_kernel(const float4* dk, const float4* dv, int64_t heads,
                                            int64_t dn4, int64_t dr4, int64_t dvh4, uint2* dkv,
                                            bf* dpe, int64_t ld_pe) {
    const int64_t t = blockIdx.x;
    const int64_t dq4 = dn4 + dr4, w4 = dn4 + dvh4;
    for (int64_t i = threadIdx.x; i < heads * w4; i += blockDim.x) {
        const int64_t h = i / w4, c = i - h * w4;
        const float4 v =
            c < dn4 ? dk[(t * heads + h) * dq4 + c] : dv[(t * heads + h) * dvh4 + c - dn4];
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y),
                             hi = __floats2bfloat162_rn(v.z, v.w);
        dkv[t * heads * w4 + i] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                             *reinterpret_cast<const uint32_t*>(&hi));
    }
    const float* dkf = reinterpret_cast<const float*>(dk);
    for (int64_t i = threadIdx.x; i < 4 * dr4; i += blockDim.x) {
        float s = 0;
        for (int64_t h = 0; h < heads; ++h) s += dkf[(t * heads + h) * 4 * dq4 + 4 * dn4 + i];
        dpe[t * ld_pe + i] = __float2bfloat16(s);
    }
}

// One block per token; bf16 pairs (dn and dr even, checked by the caller).
__global__ void expanded_keys_kernel(const __nv_bfloat162* kv, const __nv_bfloat162* pe,
                                     int64_t ld_pe2, int64_t heads, int64_t dn2, int64_t dr2,
                                     int64_t dvh2, __nv_bfloat162* k) {
    const int64_t t = blockIdx.x, dq2 = dn2 + dr2, w2 = dn2 + dvh2;
    for (int64_t i = threadIdx.x; i < heads * dq2; i += blockDim.x) {
        const int64_t h = i / dq2, c = i % dq2;
        k[t * heads * dq2 + i] = c < dn2 ? kv[(t * heads + h) * w2 + c] : pe[t * ld_pe2 + c - dn2];
    }
}

}  // namespace

void mla_expanded_kv_grad(const ExecContext& ctx, const float* dk, const float* dv, int64_t tokens,
                          int64_t heads, int64_t dn, int64_t dr, int64_t dvh, bf16* dkv, bf16* dpe,
                          int64_t ld_pe) {
    if (tokens == 0) return;
    const bool vec =
        dn % 4 == 0 && dr % 4 == 0 && dvh % 4 == 0 && reinterpret_cast<uintptr_t>(dk) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(dv) % 16 == 0 && reinterpret_cast<uintptr_t>(dkv) % 8 == 0;
    if (vec)
        expanded_kv_grad_vec_kernel<<<tokens, 256, 0, stream_of(ctx)>>>(
            reinterpret_cast<const float4*>(dk), reinterpret_cast<const float4*>(dv), heads, dn / 4,
            dr / 4, dvh / 4, reinterpret_cast<uint2*>(dkv), dev(dpe), ld_pe);
    else
        expanded_kv_grad_kernel<<<tokens, 256, 0, stream_of(ctx)>>>(dk, dv, heads, dn, dr, dvh,
                                                                    dev(dkv), dev(dpe), ld_pe);
    ST_CUDA_LAUNCH_CHECK();
}

void mla_expanded_keys(const ExecContext& ctx, const bf16* kv, const bf16* pe, int64_t ld_pe,
                       int64_t tokens, int64_t heads, int64_t dn, int64_t dr, int64_t dvh,
                       bf16* k) {
    ST_CHECK(dn % 2 == 0 && dr % 2 == 0 && dvh % 2 == 0 && ld_pe % 2 == 0,
             "expanded MLA keys: even head dimensions expected (", dn, ", ", dr, ", ", dvh, ")");
    if (tokens == 0) return;
    expanded_keys_kernel<<<tokens, 256, 0, stream_of(ctx)>>>(
        reinterpret_cast<const __nv_bfloat162*>(kv), reinterpret_cast<const __nv_bfloat162*>(pe),
        ld_pe / 2, heads, dn / 2, dr / 2, dvh / 2, reinterpret_cast<__nv_bfloat162*>(k));
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
