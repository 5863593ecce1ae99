// The backend-comparison harness (DESIGN §4): device buffers with poisoned contents and sentinel
// guards, bf16 uploads that round the host copy the same way (so the CPU reference sees the exact
// inputs the GPU sees), and a normalized-error check that fails on any NaN or Inf.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/dtype.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "test_util.h"

namespace sparsetron::test {

#define REQUIRE_GPU()                                                  \
    if (!cuda_available())                                             \
    GTEST_SKIP() << "no CUDA device visible (or built without CUDA): " \
                    "GPU tests run on the GPU machine"

// n elements of T on the device followed by kGuard sentinel bytes. Contents start poisoned
// (0xFF bytes: NaN for floats, -1 for integers) so an element an op forgets to write shows up.
template <typename T>
class DeviceArray {
  public:
    static constexpr size_t kGuard = 256;
    static constexpr uint8_t kSentinel = 0xA5;

    explicit DeviceArray(int64_t n) : n_(n) {
        base_ = static_cast<uint8_t*>(device_alloc(bytes() + kGuard));
        std::vector<uint8_t> init(bytes() + kGuard, 0xFF);
        std::memset(init.data() + bytes(), kSentinel, kGuard);
        copy_to_device(base_, init.data(), init.size());
    }
    explicit DeviceArray(const std::vector<T>& host) : DeviceArray(int64_t(host.size())) {
        upload(host);
    }
    ~DeviceArray() { device_free(base_); }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;

    T* get() const { return reinterpret_cast<T*>(base_); }
    operator T*() const { return get(); }
    int64_t size() const { return n_; }
    size_t bytes() const { return size_t(n_) * sizeof(T); }
    void upload(const std::vector<T>& host) {
        ASSERT_EQ(int64_t(host.size()), n_);
        copy_to_device(base_, host.data(), bytes());
    }
    std::vector<T> download() const {
        std::vector<T> host(n_);
        copy_to_host(host.data(), base_, bytes());
        return host;
    }
    // True when no byte after the array was written.
    bool guard_intact() const {
        std::vector<uint8_t> g(kGuard);
        copy_to_host(g.data(), base_ + bytes(), kGuard);
        for (uint8_t b : g)
            if (b != kSentinel) return false;
        return true;
    }

  private:
    int64_t n_;
    uint8_t* base_ = nullptr;
};

// Rounds `host` to bf16 in place and returns the device copy: the CPU reference then computes on
// exactly the GPU's inputs.
inline std::vector<bf16> to_bf16_rounding(std::vector<float>& host) {
    std::vector<bf16> out(host.size());
    for (size_t i = 0; i < host.size(); ++i) {
        out[i] = float_to_bf16(host[i]);
        host[i] = bf16_to_float(out[i]);
    }
    return out;
}

inline std::vector<float> to_float(const std::vector<bf16>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
    return out;
}
inline std::vector<float> to_float(const std::vector<float>& v) {
    return v;
}

// Normalized error ||gpu - ref|| / ||ref|| over the listed elements (all when `mask` is empty);
// fails on NaN/Inf in the GPU result. Prints one summary line per check.
inline void expect_close(const std::string& what, const std::vector<float>& gpu,
                         const std::vector<float>& ref, double tol,
                         const std::vector<bool>& mask = {}) {
    ASSERT_EQ(gpu.size(), ref.size()) << what;
    double num = 0, den = 0;
    int64_t bad = 0, checked = 0;
    for (size_t i = 0; i < gpu.size(); ++i) {
        if (!mask.empty() && !mask[i]) continue;
        ++checked;
        if (!std::isfinite(gpu[i])) {
            ++bad;
            continue;
        }
        const double d = double(gpu[i]) - double(ref[i]);
        num += d * d;
        den += double(ref[i]) * ref[i];
    }
    const double nerr = std::sqrt(num / std::max(den, 1e-300));
    std::cout << "[harness] " << what << ": " << checked << " values, normalized error " << nerr
              << " (tol " << tol << ")" << (bad ? ", NON-FINITE VALUES" : "") << "\n";
    EXPECT_EQ(bad, 0) << what << ": " << bad << " non-finite values (unwritten or NaN)";
    EXPECT_GT(den, 0) << what << ": the reference is all zeros; the check would mean nothing";
    EXPECT_LE(nerr, tol) << what;
}

template <typename T>
void expect_guard(const DeviceArray<T>& a, const std::string& what) {
    EXPECT_TRUE(a.guard_intact()) << what << ": an op wrote past the end of its output";
}

// The top-k rule's CPU reference (cpu::topk_row) of row[begin, begin + n), padded with -1 to k.
inline std::vector<int32_t> reference_topk(const float* row, int32_t begin, int64_t n, int64_t k) {
    std::vector<int32_t> idx(size_t(k), -1), order;
    if (n > 0) cpu::topk_row(row, begin, begin + n - 1, k, idx.data(), order);
    return idx;
}

// The sparse MQA's head-summed probabilities (cpu::sparse_mqa_prob_sums, fp64 sums).
inline std::vector<float> head_prob_sums(const std::vector<float>& q, const std::vector<float>& kv,
                                         const std::vector<int32_t>& idx,
                                         const std::vector<int32_t>& len,
                                         const std::vector<float>& lse, int64_t tokens,
                                         int64_t heads, int64_t dqk, int64_t kslots, double scale) {
    std::vector<float> sums(size_t(tokens * kslots));
    cpu::sparse_mqa_prob_sums(tokens, heads, dqk, q.data(), kv.data(), idx.data(), len.data(),
                              kslots, scale, lse.data(), sums.data());
    return sums;
}

}  // namespace sparsetron::test
