// StepGraph: a CUDA graph captured from a CudaSession's stream. Capture fails loudly (with the
// CUDA error) when anything in the captured region breaks it: an allocation, a synchronization,
// a host copy, a read of device memory on the host.
#pragma once

#include <cstddef>

#include "sparsetron/cuda/cuda_session.h"

namespace sparsetron::cuda {

class StepGraph {
  public:
    explicit StepGraph(const CudaSession& session);
    ~StepGraph();
    StepGraph(const StepGraph&) = delete;
    StepGraph& operator=(const StepGraph&) = delete;

    void begin_capture();
    void end_capture();  // throws if the capture was invalidated
    void replay() const;
    size_t nodes() const;
    bool captured() const { return exec_ != nullptr; }

  private:
    const CudaSession& session_;
    void* graph_ = nullptr;  // cudaGraph_t
    void* exec_ = nullptr;   // cudaGraphExec_t
};

}  // namespace sparsetron::cuda
