// Activation offload on CUDA (fine_grained_activation_offloading + offload_modules): the saved
// activations of the named modules wait for their backward in pinned host memory instead of
// device memory.
//
// The layer applications run forward in order g = 0..G-1 (backbone layers, then MTP depths) and
// backward in reverse. Each application's offloaded buffers are packed into one of two device
// regions, region g % 2, each as large as the largest application's buffers. After application
// g's forward its region is copied out to its host block on a side stream, and application g + 2's
// forward waits for that copy before it writes the region. After application g's backward, the
// region it frees is refilled with application g - 2's buffers on a second side stream, while the
// backward of g - 1 runs; g - 2's backward waits for that copy. The last two applications never
// leave the device (their backward follows their forward). Device memory: two regions instead of
// G applications' buffers; host memory: G - 2 applications' buffers. Every copy is ordered by
// events (graph edges), so a captured step replays the same schedule.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sparsetron/core/memory_plan.h"
#include "sparsetron/cuda/offload_copies.h"

namespace sparsetron::cuda {

class ActivationOffload {
  public:
    // `names`: each application's name (its buffers' plan names start with it), forward order.
    ActivationOffload(MemoryPlan& plan, std::vector<std::string> names);
    // While the model declares its buffers: one buffer of application g; *ptr is set by bind().
    void add(int64_t g, const std::string& name, DType dtype, const std::vector<int64_t>& shape,
             void** ptr);
    // After the last add(): plans the two device regions and the host blocks.
    void plan();
    // After plan.allocate(): sets the buffers' pointers, creates the copy streams.
    void bind(const ExecContext& ctx);

    // The step's schedule (only for steps with a backward; the forward-only steps need none):
    // before / after application g's forward, before / after its backward.
    void before_forward(int64_t g);
    void after_forward(int64_t g);
    void before_backward(int64_t g);
    void after_backward(int64_t g);

    int64_t applications() const { return int64_t(groups_.size()); }
    bool offloaded(int64_t g) const { return g + 2 < applications(); }

  private:
    struct Buffer {
        size_t offset;  // within the application's region
        void** ptr;
    };
    struct Group {
        std::string name;
        std::vector<Buffer> buffers;
        size_t bytes = 0;
        MemoryPlan::Slot host = -1;
    };
    MemoryPlan& plan_;
    std::vector<Group> groups_;
    size_t region_bytes_ = 0;
    MemoryPlan::Slot regions_[2] = {-1, -1};
    char* region_[2] = {nullptr, nullptr};
    std::vector<char*> host_;
    std::unique_ptr<cuda::OffloadCopies> copies_;
};

}  // namespace sparsetron::cuda
