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

// Phases share one area after the class's other buffers: each phase's buffers lie side by side
// from the area's start, so the class holds its plain buffers plus its largest phase, and a
// buffer of one phase overlaps those of another (never its own phase's).
TEST(MemoryPlan, PhasesOverlapEachOtherAfterThePlainBuffers) {
    MemoryPlan plan;
    auto plain = plan.add(MemClass::Workspace, "grad.residual", DType::F32, {100});  // 400 B
    auto a1 = plan.add_in_phase(MemClass::Workspace, "attention", "q", DType::F32, {300});
    auto m1 = plan.add_in_phase(MemClass::Workspace, "moe", "rows", DType::F32, {64});
    auto a2 = plan.add_in_phase(MemClass::Workspace, "attention", "o", DType::BF16, {10});
    auto m2 = plan.add_in_phase(MemClass::Workspace, "moe", "act", DType::F32, {1000});
    auto late = plan.add(MemClass::Workspace, "head.row_loss", DType::F32, {10});  // 40 B
    plan.add(MemClass::Activations, "x", DType::F32, {4});
    // Plain: 400 -> 512 + 40 = 552, the area from 768. attention: 1200 -> 1280 + 20 = 1300;
    // moe: 256 + 4000 = 4256, the larger.
    EXPECT_EQ(plan.phase_bytes(MemClass::Workspace).at("attention"), 1300u);
    EXPECT_EQ(plan.phase_bytes(MemClass::Workspace).at("moe"), 4256u);
    EXPECT_TRUE(plan.phase_bytes(MemClass::Activations).empty());
    EXPECT_EQ(plan.class_bytes(MemClass::Workspace), 768u + 4256u);
    EXPECT_EQ(plan.total_bytes(), 768u + 4256u + 16u);
    plan.allocate(Device::CPU);
    auto at = [&](MemoryPlan::Slot s) {
        return static_cast<char*>(plan.view(s).data) - plan.class_base(MemClass::Workspace);
    };
    EXPECT_EQ(at(plain), 0);
    EXPECT_EQ(at(late), 512);
    EXPECT_EQ(at(a1), 768);
    EXPECT_EQ(at(m1), 768);  // the same bytes as attention's first buffer
    EXPECT_EQ(at(a2), 768 + 1280);
    EXPECT_EQ(at(m2), 768 + 256);
    for (auto s : {plain, late, a1, m1, a2, m2})
        EXPECT_EQ(reinterpret_cast<uintptr_t>(plan.view(s).data) % 256, 0u);
    const std::string text = plan.format(10);
    EXPECT_NE(text.find("attention 1.27 KiB; moe 4.16 KiB;"), std::string::npos) << text;
    EXPECT_NE(text.find("(moe)"), std::string::npos) << text;
    EXPECT_THROW(plan.add_in_phase(MemClass::Workspace, "", "x", DType::F32, {1}), Error);
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
