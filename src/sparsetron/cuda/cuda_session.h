// CudaSession: the stream and library handles every CUDA op of one training process uses.
//
// Created once, before the first step. GEMM plans (cuBLASLt descriptors and the chosen algorithm)
// are made on first use of a shape and cached, so a warm-up step creates all of them and a captured
// step only looks them up (DESIGN §1.1).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "sparsetron/core/exec_context.h"

namespace sparsetron::cuda {

class CudaSession {
  public:
    CudaSession();
    ~CudaSession();
    CudaSession(const CudaSession&) = delete;
    CudaSession& operator=(const CudaSession&) = delete;

    const ExecContext& ctx() const { return ctx_; }
    void synchronize() const;
    // Number of cached GEMM plans (a captured step must not add any).
    size_t gemm_plans() const;
    // Milliseconds of each of `iters` runs of fn (enqueued on this stream), timed with CUDA events
    // after `warmup` untimed runs.
    std::vector<double> time_ms(const std::function<void()>& fn, int iters, int warmup = 2) const;

  private:
    std::unique_ptr<Libraries> libs_;
    ExecContext ctx_;
};

}  // namespace sparsetron::cuda
