// The copies of activation offload (model/cuda/activation_offload.h): device -> host on one
// stream, host -> device on another, each after everything enqueued on the session's stream so
// far, with one event per layer application and direction that the session's stream waits on
// before it reuses or reads the buffers. Event record / wait pairs are graph edges and copies to
// or from pinned memory are memcpy nodes, so the copies sit inside a captured step, overlapped
// with its kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sparsetron/core/exec_context.h"

namespace sparsetron::cuda {

class OffloadCopies {
  public:
    OffloadCopies(const ExecContext& main, int64_t groups);
    ~OffloadCopies();
    OffloadCopies(const OffloadCopies&) = delete;
    OffloadCopies& operator=(const OffloadCopies&) = delete;
    // bytes from `src` to `dst` for application g, once the main stream reaches this point.
    void copy_out(int64_t g, void* host, const void* device, size_t bytes);
    void copy_in(int64_t g, void* device, const void* host, size_t bytes);
    // The main stream waits for application g's copy out / in.
    void wait_out(int64_t g);
    void wait_in(int64_t g);

  private:
    void copy(void* stream, void* done, void* dst, const void* src, size_t bytes);
    ExecContext main_;
    void *d2h_ = nullptr, *h2d_ = nullptr, *fork_ = nullptr;
    std::vector<void*> out_done_, in_done_;
};

}  // namespace sparsetron::cuda
