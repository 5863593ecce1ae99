// Element-type conversion between fp32 and bf16 (round-to-nearest-even), on either backend.
#pragma once

#include "sparsetron/core/exec_context.h"

namespace sparsetron::ops {

// dst[i] = RNE(src[i]) for fp32 -> bf16, exact widening for bf16 -> fp32. Contiguous, same numel.
void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst);

namespace cuda {
void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst);
}

}  // namespace sparsetron::ops
