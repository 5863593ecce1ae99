// What a CudaSession owns besides the stream: the cuBLASLt handle, its workspace and the plan
// cache. Only CUDA sources include this header.
#pragma once

#include <cublasLt.h>

#include <array>
#include <map>

#include "sparsetron/core/cuda_check.h"

#define ST_CUBLAS_CHECK(call)                                                                     \
    do {                                                                                          \
        cublasStatus_t st_s_ = (call);                                                            \
        if (st_s_ != CUBLAS_STATUS_SUCCESS)                                                       \
            throw ::sparsetron::Error(::sparsetron::cat("cuBLASLt error ", int(st_s_), " (",      \
                                                        cublasLtGetStatusString(st_s_), ") in ",  \
                                                        #call, " at ", __FILE__, ":", __LINE__)); \
    } while (0)

namespace sparsetron::cuda {

// One GEMM shape's descriptors and the algorithm chosen for it.
struct GemmPlan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
};

struct Libraries {
    cublasLtHandle_t lt = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = 64u << 20;  // cuBLASLt's recommendation for Hopper is 32 MiB or more
    std::map<std::array<int64_t, 15>, GemmPlan> plans;
    std::map<std::array<int64_t, 7>, GemmPlan> fp8_plans;  // gemm_fp8_blockwise's
};

}  // namespace sparsetron::cuda
