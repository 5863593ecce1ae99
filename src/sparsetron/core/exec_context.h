// ExecContext: where ops run. Ops take it first (DESIGN §3).
//
// The CPU backend needs nothing but the thread pool; the CUDA backend keeps its stream and
// library handles here (opaque pointers so this header stays free of CUDA includes).
#pragma once

#include "sparsetron/core/tensor.h"

namespace sparsetron {

namespace cuda {
struct Libraries;  // cuBLASLt handle, its workspace and GEMM plan cache (cuda/cuda_session.h)
}

struct ExecContext {
    Device device = Device::CPU;
    void* stream = nullptr;           // cudaStream_t on CUDA; nullptr is the legacy default stream
    cuda::Libraries* libs = nullptr;  // set by a CudaSession; GEMMs need it

    static ExecContext cpu() { return ExecContext{}; }
};

}  // namespace sparsetron
