// A build without CUDA links this in place of device_memory.cu: no device, and every device
// memory entry point throws "built without CUDA".
#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/error.h"

namespace sparsetron {

bool cuda_available() {
    return false;
}
int cuda_device_count() {
    return 0;
}
std::string cuda_device_name() {
    return "";
}
void* device_alloc(size_t) {
    built_without_cuda("device_alloc");
}
void device_free(void*) {}
void* pinned_host_alloc(size_t) {
    built_without_cuda("pinned_host_alloc");
}
void pinned_host_free(void*) {}
void copy_to_device(void*, const void*, size_t) {
    built_without_cuda("copy_to_device");
}
void copy_to_host(void*, const void*, size_t) {
    built_without_cuda("copy_to_host");
}
size_t device_memory_used() {
    built_without_cuda("device_memory_used");
}
size_t device_memory_free() {
    built_without_cuda("device_memory_free");
}

}  // namespace sparsetron
