#include "sparsetron/cuda/side_stream.h"

#include "sparsetron/core/cuda_check.h"

namespace sparsetron::cuda {

SideStream::SideStream(const ExecContext& main) : main_(main), ctx_(main) {
    cudaStream_t s = nullptr;
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ctx_.stream = s;
    cudaEvent_t a = nullptr, b = nullptr;
    ST_CUDA_CHECK(cudaEventCreateWithFlags(&a, cudaEventDisableTiming));
    ST_CUDA_CHECK(cudaEventCreateWithFlags(&b, cudaEventDisableTiming));
    fork_event_ = a, join_event_ = b;
}

SideStream::~SideStream() {
    cudaEventDestroy(static_cast<cudaEvent_t>(fork_event_));
    cudaEventDestroy(static_cast<cudaEvent_t>(join_event_));
    cudaStreamDestroy(static_cast<cudaStream_t>(ctx_.stream));
}

void SideStream::fork() {
    ST_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(fork_event_),
                                  static_cast<cudaStream_t>(main_.stream)));
    ST_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(ctx_.stream),
                                      static_cast<cudaEvent_t>(fork_event_), 0));
}

void SideStream::join() {
    ST_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(join_event_),
                                  static_cast<cudaStream_t>(ctx_.stream)));
    ST_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(main_.stream),
                                      static_cast<cudaEvent_t>(join_event_), 0));
}

}  // namespace sparsetron::cuda
