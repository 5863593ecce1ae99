// What the current device can run (device_caps.h).
#include <cuda_runtime.h>
#include "sparsetron/cuda/device_caps.h"

#include "sparsetron/core/cuda_check.h"

namespace sparsetron::cuda {

bool has_sm90a() {
    static const bool hopper = [] {
        int device = 0, major = 0, minor = 0;
        ST_CUDA_CHECK(cudaGetDevice(&device));
        ST_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        ST_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        return major == 9 && minor == 0;
    }();
    return hopper;
}

}  // namespace sparsetron::cuda
