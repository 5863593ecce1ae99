#include <gtest/gtest.h>

#include <string>

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

// Buffers alike but for layer or expert numbers are one kind, summed: three layers' received rows
// (12 KiB) outweigh the single largest buffer (8 KiB), which a per-buffer list would put first.
TEST(MemoryPlan, KindsSumBuffersAlikeButForTheirNumbers) {
    MemoryPlan plan;
    for (int l = 2; l < 5; ++l)
        plan.add(MemClass::Activations, "layers." + std::to_string(l) + ".moe.x_received",
                 DType::BF16, {2048});
    plan.add(MemClass::Workspace, "dsa.scores", DType::F32, {2048});
    for (int e = 0; e < 2; ++e)
        plan.add(MemClass::Parameters,
                 "model.layers.10.mlp.experts." + std::to_string(e) + ".up_proj.weight", DType::F32,
                 {64});
    plan.add(MemClass::Parameters, "model.layers.11.mlp.experts.0.up_proj.weight.bf16", DType::BF16,
             {64});
    const auto k = plan.kinds();
    ASSERT_EQ(k.size(), 4u);
    EXPECT_EQ(k[0].pattern, "layers.*.moe.x_received");
    EXPECT_EQ(k[0].cls, MemClass::Activations);
    EXPECT_EQ(k[0].count, 3);
    EXPECT_EQ(k[0].bytes, 3u * 4096u);
    EXPECT_EQ(k[1].pattern, "dsa.scores");
    EXPECT_EQ(k[2].pattern, "model.layers.*.mlp.experts.*.up_proj.weight");
    EXPECT_EQ(k[2].count, 2);
    EXPECT_EQ(k[3].pattern, "model.layers.*.mlp.experts.*.up_proj.weight.bf16");
    const std::string text = plan.format_kinds(2);
    EXPECT_NE(text.find("layers.*.moe.x_received"), std::string::npos) << text;
    EXPECT_NE(text.find("3 x 4.00 KiB"), std::string::npos) << text;
    EXPECT_EQ(text.find("up_proj"), std::string::npos) << "only the two largest: " << text;
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
