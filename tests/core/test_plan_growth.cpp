#include <gtest/gtest.h>

#include <algorithm>

#include "sparsetron/core/plan_growth.h"

using namespace sparsetron;

namespace {

constexpr int64_t kVocab = 1000, kChunk = 512;

// A plan at `tokens` with one buffer of each growth the analysis tells apart.
MemoryPlan plan_at(int64_t tokens) {
    MemoryPlan p;
    p.add(MemClass::Parameters, "embed", DType::F32, {kVocab, 64});      // constant, vocab dim
    p.add(MemClass::Activations, "hidden", DType::BF16, {tokens, 64});   // linear
    p.add(MemClass::Workspace, "scores", DType::F32, {tokens, tokens});  // quadratic
    p.add(MemClass::Workspace, "logits_chunk", DType::F32,               // bounded by the chunk
          {std::min(tokens, kChunk), kVocab});
    p.add(MemClass::Workspace, "dlogits", DType::BF16, {tokens, kVocab});  // tokens x vocab
    if (tokens >= 2048) p.add(MemClass::Activations, "late", DType::BF16, {tokens, 8});
    return p;
}

std::vector<std::string> names(const std::vector<const BufferGrowth*>& found) {
    std::vector<std::string> out;
    for (const BufferGrowth* b : found) out.push_back(b->name);
    return out;
}

}  // namespace

TEST(PlanGrowth, FlagsQuadraticAndLateBuffersAndTokensByVocab) {
    const std::vector<int64_t> lengths = {256, 1024, 4096};
    MemoryPlan a = plan_at(256), b = plan_at(1024), c = plan_at(4096);
    const PlanGrowth g = plan_growth(lengths, {&a, &b, &c}, kVocab);
    // Largest at the longest length first: scores (64 MiB) before late (64 KiB).
    EXPECT_EQ(names(g.faster_than_linear()), (std::vector<std::string>{"scores", "late"}));
    const auto by_name = [&](const std::string& n) {
        return *std::find_if(g.buffers.begin(), g.buffers.end(),
                             [&](const BufferGrowth& x) { return x.name == n; });
    };
    EXPECT_DOUBLE_EQ(by_name("scores").excess, 4.0);  // 16x the bytes for 4x the tokens
    EXPECT_DOUBLE_EQ(by_name("hidden").excess, 1.0);
    EXPECT_DOUBLE_EQ(by_name("embed").excess, 0.25);
    EXPECT_DOUBLE_EQ(by_name("logits_chunk").excess, 0.5);  // 256 -> 512 rows, then none
    EXPECT_EQ(by_name("late").bytes[0], 0u);
    EXPECT_EQ(by_name("late").bytes[2], 4096u * 8 * 2);
    // The chunk stops growing once the micro-batch outgrows it; the parameter never grows.
    EXPECT_EQ(names(g.tokens_by_vocab()), (std::vector<std::string>{"dlogits"}));
    EXPECT_EQ(g.class_bytes[2][int(MemClass::Workspace)], c.class_bytes(MemClass::Workspace));
    const std::string text = g.format();
    EXPECT_NE(text.find("2 buffers grow faster than the tokens"), std::string::npos) << text;
    EXPECT_NE(text.find("1 buffers of tokens x vocabulary (1000)"), std::string::npos) << text;
}

TEST(PlanGrowth, LinearPlansPassAndBadLengthsAreRefused) {
    MemoryPlan a, b;
    a.add(MemClass::Activations, "x", DType::F32, {100, 3});
    b.add(MemClass::Activations, "x", DType::F32, {200, 3});
    const PlanGrowth g = plan_growth({100, 200}, {&a, &b}, kVocab);
    EXPECT_TRUE(g.faster_than_linear().empty());
    EXPECT_TRUE(g.tokens_by_vocab().empty());
    EXPECT_NE(g.format().find("every buffer grows at most linearly"), std::string::npos);
    EXPECT_THROW(plan_growth({200, 100}, {&a, &b}), Error);
    EXPECT_THROW(plan_growth({100}, {&a}), Error);
    EXPECT_THROW(plan_growth({100, 200}, {&a}), Error);
}
