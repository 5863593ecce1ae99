// The shapes the tensor-core gathered sparse MQA kernels (sparse_mqa_tc.cu) take: a block holds
// one token and a group of heads, its shared memory the group's queries and a chunk of keys.
// Host arithmetic, shared by the kernels and the attention plan.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparsetron::cuda::tc_shape {

constexpr int kWarps = 8;
constexpr int kHeadsPerBlock = 32;
constexpr int kForwardKeys = 64;   // keys per chunk, forward
constexpr int kBackwardKeys = 32;  // keys per chunk, backward
constexpr int kMaxQkDim = 576;     // qk dim bound (shared memory)
constexpr size_t kSmemLimit = 227 * 1024;
constexpr size_t kBf = 2;

constexpr size_t forward_smem(int64_t dqk, int64_t dv) {
    return size_t(kHeadsPerBlock * dqk + kForwardKeys * dqk) * kBf +
           size_t(kHeadsPerBlock * dv + kHeadsPerBlock * kForwardKeys) * sizeof(float) +
           size_t(kHeadsPerBlock * kForwardKeys) * kBf;
}
constexpr size_t backward_smem(int64_t dqk, int64_t dv) {
    return size_t(kHeadsPerBlock * dqk + kHeadsPerBlock * dv + kBackwardKeys * dqk) * kBf +
           size_t(kHeadsPerBlock * dqk + 2 * kHeadsPerBlock * kBackwardKeys) * sizeof(float) +
           size_t(2 * kHeadsPerBlock * kBackwardKeys) * kBf + size_t(kWarps * 256) * sizeof(float);
}

}  // namespace sparsetron::cuda::tc_shape
