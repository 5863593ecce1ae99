#include "sparsetron/cuda/chunk_graphs.h"

namespace sparsetron::cuda {

void ChunkGraphs::run(const std::string& key, const std::function<void()>& enqueue) {
    const auto it = graphs_.find(key);
    if (it == graphs_.end()) {
        enqueue();
        graphs_.emplace(key, nullptr);
        return;
    }
    std::unique_ptr<StepGraph>& g = it->second;
    if (!g) {
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
