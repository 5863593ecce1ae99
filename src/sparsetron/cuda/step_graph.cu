#include "sparsetron/core/cuda_check.h"
#include "sparsetron/cuda/step_graph.h"

namespace sparsetron::cuda {
namespace {
cudaStream_t stream(const CudaSession& s) {
    return static_cast<cudaStream_t>(s.ctx().stream);
}
}  // namespace

StepGraph::StepGraph(const CudaSession& session) : session_(session) {}

StepGraph::~StepGraph() {
    if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
}

void StepGraph::begin_capture() {
    ST_CHECK(!exec_ && !graph_, "StepGraph: already captured");
    // Global mode: any unsafe CUDA call from any thread during the capture invalidates it.
    ST_CUDA_CHECK(cudaStreamBeginCapture(stream(session_), cudaStreamCaptureModeGlobal));
}

void StepGraph::end_capture() {
    cudaGraph_t g = nullptr;
    const cudaError_t err = cudaStreamEndCapture(stream(session_), &g);
    if (err != cudaSuccess) {
        cudaGetLastError();  // clear the sticky capture error
        throw Error(cat("CUDA graph capture of the step failed: ", cudaGetErrorName(err), " (",
                        cudaGetErrorString(err),
                        "); something in the step allocated, synchronized or copied to the host"));
    }
    graph_ = g;
    cudaGraphExec_t exec = nullptr;
    ST_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    exec_ = exec;
}

void StepGraph::replay() const {
    ST_CHECK(exec_, "StepGraph: nothing captured");
    ST_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), stream(session_)));
}

size_t StepGraph::nodes() const {
    if (!graph_) return 0;
    size_t n = 0;
    ST_CUDA_CHECK(cudaGraphGetNodes(static_cast<cudaGraph_t>(graph_), nullptr, &n));
    return n;
}

}  // namespace sparsetron::cuda
