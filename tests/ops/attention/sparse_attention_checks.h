// The sparse attention's checks against the CPU reference that more than one test file walks:
// the expanded form (test_sparse_mha_masked_cuda.cpp) for the case table of
// test_attention_cuda.cpp.
#pragma once

#include <string>

#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/ops/attention/attention.h"

namespace sparsetron::test {

// The expanded form in `plan` (ExpandedMasked) on 200 rows of H heads (qk dims dqk = dn + rope,
// value dims dv) against the CPU's absorbed-form reference head by head. head_sums: the forward
// also sums the probabilities over the heads (the indexer loss's teacher); without them, on sm_90
// at qk 256, the forward runs masked_probs_wgmma.
void sparse_mha_check(const cuda::CudaSession& session, int64_t H, int64_t dqk, int64_t dn,
                      int64_t dv, int64_t K, const cuda::SparseAttentionPlan& plan,
                      const std::string& tag, bool head_sums);

}  // namespace sparsetron::test
