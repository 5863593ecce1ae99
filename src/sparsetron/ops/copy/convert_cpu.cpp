#include "sparsetron/ops/copy/copy.h"

#include "sparsetron/core/thread_pool.h"

namespace sparsetron::ops {

void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst) {
    ST_ASSERT(src.numel() == dst.numel() && src.is_contiguous() && dst.is_contiguous(), "convert ",
              src.describe(), " -> ", dst.describe());
    ST_ASSERT(src.device == ctx.device && dst.device == ctx.device, "convert on wrong device");
    if (ctx.device == Device::CUDA) return cuda::convert(ctx, src, dst);
    int64_t n = src.numel();
    if (src.dtype == DType::F32 && dst.dtype == DType::BF16) {
        const float* s = src.ptr<float>();
        bf16* d = dst.ptr<bf16>();
        parallel_for(
            n,
            [&](int64_t b, int64_t e) {
                for (int64_t i = b; i < e; ++i) d[i] = float_to_bf16(s[i]);
            },
            1 << 14);
    } else if (src.dtype == DType::BF16 && dst.dtype == DType::F32) {
        const bf16* s = src.ptr<bf16>();
        float* d = dst.ptr<float>();
        parallel_for(
            n,
            [&](int64_t b, int64_t e) {
                for (int64_t i = b; i < e; ++i) d[i] = bf16_to_float(s[i]);
            },
            1 << 14);
    } else {
        throw Error(
            cat("convert: unsupported ", dtype_name(src.dtype), " -> ", dtype_name(dst.dtype)));
    }
}

}  // namespace sparsetron::ops
