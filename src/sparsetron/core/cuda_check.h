// Checked CUDA calls: every failure names the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include "sparsetron/core/error.h"

#define ST_CUDA_CHECK(call)                                                                  \
    do {                                                                                     \
        cudaError_t st_err_ = (call);                                                        \
        if (st_err_ != cudaSuccess)                                                          \
            throw ::sparsetron::Error(::sparsetron::cat(                                     \
                "CUDA error ", cudaGetErrorName(st_err_), " (", cudaGetErrorString(st_err_), \
                ") in ", #call, " at ", __FILE__, ":", __LINE__));                           \
    } while (0)

// After every kernel launch: catches bad launch configurations close to their source.
#define ST_CUDA_LAUNCH_CHECK() ST_CUDA_CHECK(cudaGetLastError())
