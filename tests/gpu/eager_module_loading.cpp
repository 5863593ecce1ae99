// test_gpu runs the ranks of a job as threads of one process on one GPU. With CUDA's lazy module
// loading, a kernel's first launch synchronizes the context, so a rank loading a kernel would wait
// for a peer's expert-exchange kernel that spins until this rank publishes: a deadlock. Loading
// every module when CUDA starts removes it; this runs before main, so before any CUDA call.
#include <cstdlib>

namespace {
const bool kEagerModuleLoading = [] {
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);  // a caller's own choice stands
    return true;
}();
}  // namespace
