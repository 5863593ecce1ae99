// A second stream beside the session's, ordered against it by events (fork: the side stream waits
// for everything enqueued on the main stream so far; join: the main stream waits for the side
// stream). Event record / wait pairs are captured as graph edges, so work forked this way (the
// data-parallel gradient all-reduce overlapping the backward) sits inside a captured step.
#pragma once

#include "sparsetron/core/exec_context.h"

namespace sparsetron::cuda {

class SideStream {
  public:
    explicit SideStream(const ExecContext& main);
    ~SideStream();
    SideStream(const SideStream&) = delete;
    SideStream& operator=(const SideStream&) = delete;
    void fork();
    void join();
    void* stream() const { return ctx_.stream; }
    const ExecContext& ctx() const { return ctx_; }

  private:
    ExecContext main_, ctx_;
    void *fork_event_ = nullptr, *join_event_ = nullptr;
};

}  // namespace sparsetron::cuda
