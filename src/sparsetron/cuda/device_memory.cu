#include "sparsetron/core/cuda_check.h"
#include "sparsetron/core/device_memory.h"

namespace sparsetron {

bool cuda_available() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

int cuda_device_count() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string cuda_device_name() {
    if (!cuda_available()) return "";
    int dev = 0;
    ST_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    ST_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    return prop.name;
}

void* device_alloc(size_t bytes) {
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        throw Error(cat("cudaMalloc of ", bytes, " bytes failed (", cudaGetErrorString(err),
                        "); device has ", free_b, " of ", total_b, " bytes free"));
    }
    return p;
}

void device_free(void* p) {
    cudaFree(p);
}

void* pinned_host_alloc(size_t bytes) {
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (err != cudaSuccess)
        throw Error(cat("cudaHostAlloc of ", bytes, " bytes of pinned host memory failed (",
                        cudaGetErrorString(err), ")"));
    return p;
}

void pinned_host_free(void* p) {
    cudaFreeHost(p);
}

// cudaMemcpyDefault: the side may be pinned host memory the plan gives the device (optimizer
// offload), which unified addressing tells apart.
void copy_to_device(void* dst, const void* src, size_t bytes) {
    ST_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
    // From pageable memory cudaMemcpy returns once the bytes are staged, before the DMA lands,
    // and the legacy stream it ran on does not order the sessions' non-blocking streams: wait
    // for it, so a kernel enqueued next on any stream reads what was copied.
    ST_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
    ST_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

size_t device_memory_free() {
    size_t free_b = 0, total_b = 0;
    ST_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
}

size_t device_memory_used() {
    size_t free_b = 0, total_b = 0;
    ST_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return total_b - free_b;
}

}  // namespace sparsetron
