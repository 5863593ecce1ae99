// How each planned buffer's bytes grow with the micro-batch's tokens, from plans of one recipe at
// several lengths. Long contexts need every buffer to grow at most linearly in tokens (and the
// workspaces to stay bounded): a buffer of tokens x tokens or tokens x vocab is what makes a
// 32K-token plan outgrow a GPU. `sparsetron plan --lengths` prints this analysis.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/core/memory_plan.h"

namespace sparsetron {

struct BufferGrowth {
    std::string name;
    MemClass cls;
    std::vector<size_t> bytes;   // per length; 0 where that length's plan lacks the buffer
    std::vector<int64_t> shape;  // at the longest length that has it
    // The largest factor by which the bytes outgrow the tokens between consecutive lengths:
    // 1 for a buffer linear in tokens, < 1 for a bounded one, ~ L2/L1 for tokens x tokens.
    double excess = 0;
};

struct PlanGrowth {
    std::vector<int64_t> lengths;  // ascending
    int64_t vocab = 0;             // the vocabulary size, 0 when not checked
    std::vector<BufferGrowth> buffers;
    std::vector<std::array<size_t, kNumMemClasses>> class_bytes;  // per length

    // Buffers whose bytes grow faster than the tokens by more than `tolerance` (relative) between
    // some pair of consecutive lengths, largest at the longest length first.
    std::vector<const BufferGrowth*> faster_than_linear(double tolerance = 0.01) const;
    // Buffers with a vocabulary-sized dimension whose bytes still grow between the two longest
    // lengths (tokens x vocab: logits or their gradients held for more than a bounded chunk of
    // rows). Any dimension equal to the vocabulary size counts, so a toy model whose vocabulary
    // equals another width lists that buffer too.
    std::vector<const BufferGrowth*> tokens_by_vocab() const;
    // Per-class totals at every length, then the buffers faster than linear and those of
    // tokens x vocab.
    std::string format(int top = 12) const;
};

// `plans[i]` is the plan at `lengths[i]` tokens per micro-batch; lengths strictly ascending.
PlanGrowth plan_growth(const std::vector<int64_t>& lengths,
                       const std::vector<const MemoryPlan*>& plans, int64_t vocab = 0);

}  // namespace sparsetron
