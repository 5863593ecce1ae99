#include "sparsetron/core/cuda_check.h"
#include "sparsetron/cuda/offload_copies.h"

namespace sparsetron::cuda {
namespace {

cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    ST_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
}

}  // namespace

OffloadCopies::OffloadCopies(const ExecContext& main, int64_t groups) : main_(main) {
    cudaStream_t a = nullptr, b = nullptr;
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    d2h_ = a, h2d_ = b, fork_ = event();
    for (int64_t g = 0; g < groups; ++g) {
        out_done_.push_back(event());
        in_done_.push_back(event());
    }
}

OffloadCopies::~OffloadCopies() {
    for (void* e : out_done_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
    for (void* e : in_done_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
    cudaEventDestroy(static_cast<cudaEvent_t>(fork_));
    cudaStreamDestroy(static_cast<cudaStream_t>(d2h_));
    cudaStreamDestroy(static_cast<cudaStream_t>(h2d_));
}

void OffloadCopies::copy(void* stream, void* done, void* dst, const void* src, size_t bytes) {
    const auto s = static_cast<cudaStream_t>(stream);
    const auto f = static_cast<cudaEvent_t>(fork_);
    ST_CUDA_CHECK(cudaEventRecord(f, static_cast<cudaStream_t>(main_.stream)));
    ST_CUDA_CHECK(cudaStreamWaitEvent(s, f, 0));
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    ST_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(done), s));
}

void OffloadCopies::copy_out(int64_t g, void* host, const void* device, size_t bytes) {
    copy(d2h_, out_done_[size_t(g)], host, device, bytes);
}

void OffloadCopies::copy_in(int64_t g, void* device, const void* host, size_t bytes) {
    copy(h2d_, in_done_[size_t(g)], device, host, bytes);
}

void OffloadCopies::wait_out(int64_t g) {
    ST_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(main_.stream),
                                      static_cast<cudaEvent_t>(out_done_[size_t(g)]), 0));
}

void OffloadCopies::wait_in(int64_t g) {
    ST_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(main_.stream),
                                      static_cast<cudaEvent_t>(in_done_[size_t(g)]), 0));
}

}  // namespace sparsetron::cuda
