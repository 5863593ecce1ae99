// The fixture of the op-level GPU tests: a CUDA session per test, skipped with a message where no
// device is visible. Include only where SPARSETRON_WITH_CUDA is set.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "gpu/harness.h"
#include "sparsetron/cuda/cuda_session.h"

namespace sparsetron::test {

class CudaSessionTest : public ::testing::Test {
  protected:
    void SetUp() override {
        if (!cuda_available())
            GTEST_SKIP() << "no CUDA device visible: GPU tests run on the GPU machine";
        session_ = std::make_unique<cuda::CudaSession>();
    }
    const ExecContext& ctx() const { return session_->ctx(); }
    void sync() const { session_->synchronize(); }
    std::unique_ptr<cuda::CudaSession> session_;
};

}  // namespace sparsetron::test
