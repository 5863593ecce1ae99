// Chunk-wise CUDA graphs (cuda_graph_impl: local, the seed's per-layer graphs): each chunk of a
// step's work (a layer's forward or backward, the head and MTP) runs eagerly until capturing is
// on (after the warm-up steps: GEMM plans, kernel attributes), is captured the first time it runs
// then and replayed from then on, between the parts of the step that stay eager (inputs, pipeline
// transfers, offload copies, gradient reductions, the optimizer). Every chunk reads and writes the
// static memory plan, so the graphs share it as their one pool. A chunk's key names everything its
// work depends on besides buffer contents (the layer, the pass, host flags, the CP group).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "sparsetron/cuda/step_graph.h"

namespace sparsetron::cuda {

class ChunkGraphs {
  public:
    explicit ChunkGraphs(const CudaSession& session) : session_(session) {}
    // `enqueue` for the chunk `key`: eagerly, captured, or replayed (see above).
    void run(const std::string& key, const std::function<void()>& enqueue);
    // From now on chunks without a graph are captured (off: they run eagerly).
    void set_capturing(bool on) { capturing_ = on; }
    int64_t captures() const { return captures_; }
    int64_t replays() const { return replays_; }

  private:
    const CudaSession& session_;
    std::map<std::string, std::unique_ptr<StepGraph>> graphs_;
    bool capturing_ = false;
    int64_t captures_ = 0, replays_ = 0;
};

}  // namespace sparsetron::cuda
