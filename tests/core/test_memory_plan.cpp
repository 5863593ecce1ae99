#include <gtest/gtest.h>

#include "sparsetron/core/memory_plan.h"

using namespace sparsetron;

TEST(MemoryPlan, ClassesAlignedAndSized) {
    MemoryPlan plan;
    auto a = plan.add(MemClass::Parameters, "a", DType::F32, {3, 5});
    auto b = plan.add(MemClass::Parameters, "b", DType::BF16, {7});
    auto c = plan.add(MemClass::Activations, "c", DType::I32, {2, 2, 2});
    EXPECT_EQ(plan.entries()[a].offset, 0u);
    EXPECT_EQ(plan.entries()[b].offset, 256u);  // 60 bytes rounded up to the 256-byte alignment
    EXPECT_EQ(plan.class_bytes(MemClass::Parameters), 256u + 14u);
    EXPECT_EQ(plan.class_bytes(MemClass::Activations), 32u);
    EXPECT_EQ(plan.total_bytes(), 256u + 14u + 32u);
    plan.allocate(Device::CPU);
    Tensor ta = plan.view(a), tc = plan.view(c);
    EXPECT_EQ(ta.numel(), 15);
    EXPECT_TRUE(ta.is_contiguous());
    EXPECT_EQ(tc.shape[2], 2);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(plan.view(b).data) % 256, 0u);
    EXPECT_EQ(ta.ptr<float>()[14], 0.0f);  // zero-filled
    EXPECT_NE(plan.format().find("parameters"), std::string::npos);
}

TEST(MemoryPlan, RejectsZeroDimensionsAndLateAdds) {
    MemoryPlan plan;
    EXPECT_THROW(plan.add(MemClass::Workspace, "bad", DType::F32, {4, 0}), Error);
    plan.add(MemClass::Workspace, "ok", DType::F32, {4});
    plan.allocate(Device::CPU);
    EXPECT_THROW(plan.add(MemClass::Workspace, "late", DType::F32, {4}), Error);
}

TEST(Tensor, ViewsKeepStrides) {
    float data[12];
    for (int i = 0; i < 12; ++i) data[i] = float(i);
    Tensor t(data, DType::F32, {3, 4});
    Tensor cols = t.narrow_last(1, 2);
    EXPECT_FALSE(cols.is_contiguous());
    EXPECT_EQ(cols.ptr<float>()[0], 1.0f);
    EXPECT_EQ(cols.stride[0], 4);
    Tensor r = t.rows(1, 2);
    EXPECT_EQ(r.ptr<float>()[0], 4.0f);
    EXPECT_THROW(t.ptr<double>(), Error);
    EXPECT_THROW(cols.reshape({6}), Error);
}
