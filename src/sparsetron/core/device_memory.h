// Device allocation entry points. Implemented by the CUDA backend (cuda/device_memory.cu), or by
// stubs that throw "built without CUDA" in a CPU-only build.
#pragma once

#include <cstddef>
#include <string>

namespace sparsetron {

bool cuda_available();           // built with CUDA and at least one device visible
int cuda_device_count();         // visible devices (0 without CUDA)
std::string cuda_device_name();  // "" when none
void* device_alloc(size_t bytes);
void device_free(void* p);
// Page-locked host memory (cudaHostAlloc): what asynchronous device <-> host copies need.
void* pinned_host_alloc(size_t bytes);
void pinned_host_free(void* p);
// Synchronous: the bytes are on the device when it returns (work on any stream sees them).
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
// Bytes of device memory in use by every process on the current device (total - free).
size_t device_memory_used();
// Bytes of device memory free on the current device.
size_t device_memory_free();

}  // namespace sparsetron
