#include "sparsetron/cuda/chunk_graphs.h"

namespace sparsetron::cuda {

void ChunkGraphs::run(const std::string& key, const std::function<void()>& enqueue) {
    std::unique_ptr<StepGraph>& g = graphs_[key];
    if (!g) {
        if (!capturing_) {
            enqueue();
            return;
        }
        g = std::make_unique<StepGraph>(session_);
        g->begin_capture();
        enqueue();
        g->end_capture();
        ++captures_;
    }
    g->replay();
    ++replays_;
}

}  // namespace sparsetron::cuda
