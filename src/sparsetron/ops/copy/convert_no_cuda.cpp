// A build without CUDA links this in place of convert.cu.
#include "sparsetron/core/error.h"
#include "sparsetron/ops/copy/copy.h"

namespace sparsetron::cuda {

void convert(const ExecContext&, const Tensor&, const Tensor&) {
    built_without_cuda("cuda::convert");
}

}  // namespace sparsetron::cuda
