// CUDA backend against the CPU backend (label gpu). Without a GPU every test skips with a message.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/ops/copy/copy.h"
#include "test_util.h"

using namespace sparsetron;

namespace {
#define REQUIRE_GPU()                                                  \
    if (!cuda_available())                                             \
    GTEST_SKIP() << "no CUDA device visible (or built without CUDA): " \
                    "GPU tests run on the GPU machine"
}  // namespace

TEST(CudaBackend, ConvertMatchesCpuBitForBit) {
    REQUIRE_GPU();
    const int64_t n = 1 << 20;
    auto host = test::random_vector<float>(n, 3, 1e3);
    host[0] = std::numeric_limits<float>::quiet_NaN();
    host[1] = std::numeric_limits<float>::max();
    host[2] = 1.0f + 0x1p-8f;  // a rounding tie
    host[3] = -0.0f;
    MemoryPlan plan;
    auto src = plan.add(MemClass::Workspace, "src", DType::F32, {n});
    auto dst = plan.add(MemClass::Workspace, "dst", DType::BF16, {n});
    auto back = plan.add(MemClass::Workspace, "back", DType::F32, {n});
    // Guard bytes after the output catch out-of-bounds writes.
    auto guard = plan.add(MemClass::Workspace, "guard", DType::U8, {256});
    plan.allocate(Device::CUDA);
    ExecContext ctx;
    ctx.device = Device::CUDA;
    copy_to_device(plan.view(src).data, host.data(), n * 4);
    std::vector<uint8_t> sentinel(256, 0xA5), poison(n * 2, 0xFF);
    copy_to_device(plan.view(guard).data, sentinel.data(), 256);
    copy_to_device(plan.view(dst).data, poison.data(), n * 2);  // unwritten elements would show
    ops::convert(ctx, plan.view(src), plan.view(dst));
    ops::convert(ctx, plan.view(dst), plan.view(back));
    std::vector<bf16> gpu(n);
    std::vector<float> gpu_back(n);
    std::vector<uint8_t> guard_after(256);
    copy_to_host(gpu.data(), plan.view(dst).data, n * 2);
    copy_to_host(gpu_back.data(), plan.view(back).data, n * 4);
    copy_to_host(guard_after.data(), plan.view(guard).data, 256);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
        bf16 ref = float_to_bf16(host[i]);
        bool both_nan = std::isnan(bf16_to_float(ref)) && std::isnan(bf16_to_float(gpu[i]));
        if (!both_nan && ref.bits != gpu[i].bits) ++mismatches;
        if (!both_nan && bf16_to_float(ref) != gpu_back[i]) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_EQ(guard_after, sentinel);
}

TEST(CudaBackend, DevicePlanViewsAreOnTheDevice) {
    REQUIRE_GPU();
    MemoryPlan plan;
    auto a = plan.add(MemClass::Parameters, "a", DType::F32, {3, 7});
    plan.allocate(Device::CUDA);
    EXPECT_EQ(plan.view(a).device, Device::CUDA);
    EXPECT_FALSE(cuda_device_name().empty());
}
