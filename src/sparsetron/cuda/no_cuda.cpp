// A build without CUDA links these: every CUDA entry point throws "built without CUDA".
#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/error.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/runtime/device_engine.h"
#include "sparsetron/runtime/exchange_bench.h"

namespace sparsetron {
namespace {
[[noreturn]] void no_cuda(const char* what) {
    throw Error(cat(what, ": Sparsetron was built without CUDA (rebuild with nvcc on PATH)"));
}
}  // namespace

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
    no_cuda("device_alloc");
}
void device_free(void*) {}
void* pinned_host_alloc(size_t) {
    no_cuda("pinned_host_alloc");
}
void pinned_host_free(void*) {}
void copy_to_device(void*, const void*, size_t) {
    no_cuda("copy_to_device");
}
void copy_to_host(void*, const void*, size_t) {
    no_cuda("copy_to_host");
}
size_t device_memory_used() {
    no_cuda("device_memory_used");
}
size_t device_memory_free() {
    no_cuda("device_memory_free");
}

namespace cuda {
void convert(const ExecContext&, const Tensor&, const Tensor&) {
    no_cuda("cuda::convert");
}
}  // namespace cuda

MemoryPlan cuda_memory_plan(const Recipe&, const ParamStore&, int64_t, int64_t,
                            const PipelineStage&) {
    no_cuda("plan --device cuda");
}
std::string cuda_plan_shortfall(const Recipe&, const ParamStore&, int64_t, int64_t, size_t, size_t,
                                const PipelineStage&) {
    no_cuda("cuda_plan_shortfall");
}
std::string format_cuda_plan(const Recipe&, const ParamStore&, int64_t, int64_t, size_t*, int,
                             const PipelineStage&) {
    no_cuda("plan --device cuda");
}
std::unique_ptr<DeviceEngine> make_cuda_engine(const Recipe&, const ParamStore&, const MemoryPlan&,
                                               const Optimizer&, int64_t, int64_t, Comm*, Comm*,
                                               Comm*, Comm*, Comm*, Comm*) {
    no_cuda("--device cuda");
}

ExchangeBenchResult bench_expert_exchange(Comm&, const ExchangeBenchOptions&) {
    no_cuda("bench-exchange");
}

}  // namespace sparsetron
