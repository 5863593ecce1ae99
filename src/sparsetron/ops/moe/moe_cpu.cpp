// The MoE router and permutation's CPU reference (moe.h), as the model's CPU layers run them; the
// CUDA router and permutation are checked against these.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cpu {

template <typename T>
void router_topk(const T* logits, const T* bias, int64_t tokens, int64_t routed, int64_t experts,
                 int64_t k, bool force_balance, double scaling, T* probs, int32_t* topk, T* gates) {
    parallel_for(
        tokens * experts,
        [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i)
                probs[i] = static_cast<T>(1.0 / (1.0 + std::exp(-double(logits[i]))));
        },
        4096);
    parallel_for(
        routed,
        [&](int64_t b, int64_t e) {
            std::vector<int32_t> order(static_cast<size_t>(experts));
            for (int64_t t = b; t < e; ++t) {
                const T* s = probs + t * experts;
                int32_t* chosen = topk + t * k;
                if (force_balance) {
                    for (int64_t j = 0; j < k; ++j)
                        chosen[j] = static_cast<int32_t>((t * k + j) % experts);
                } else {
                    std::iota(order.begin(), order.end(), 0);
                    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                                      [&](int32_t x, int32_t y) {
                                          T vx = s[x] + bias[x], vy = s[y] + bias[y];
                                          return vx > vy || (vx == vy && x < y);
                                      });
                    std::copy_n(order.begin(), k, chosen);
                }
                double sum = 1e-20;
                for (int64_t j = 0; j < k; ++j) sum += double(s[chosen[j]]);
                for (int64_t j = 0; j < k; ++j)
                    gates[t * k + j] = static_cast<T>(double(s[chosen[j]]) / sum * scaling);
            }
        },
        8);
}

void moe_permute(const int32_t* topk, int64_t routed, int64_t tokens, int64_t experts, int64_t k,
                 int64_t capacity, int64_t* counts, int64_t* offsets, int32_t* slot_row,
                 int32_t* perm_token) {
    std::fill_n(counts, experts, int64_t(0));
    for (int64_t t = 0; t < routed; ++t)
        for (int64_t j = 0; j < k; ++j) ++counts[topk[t * k + j]];
    offsets[0] = 0;
    for (int64_t e = 0; e < experts; ++e)
        offsets[e + 1] = offsets[e] + std::min(counts[e], capacity);
    std::vector<int64_t> fill(offsets, offsets + experts);
    std::fill_n(slot_row, tokens * k, -1);
    for (int64_t t = 0; t < routed; ++t)
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = topk[t * k + j];
            if (fill[e] < offsets[e + 1]) {
                slot_row[t * k + j] = static_cast<int32_t>(fill[e]);
                perm_token[fill[e]++] = static_cast<int32_t>(t);
            }
        }
}

#define INSTANTIATE(T)                                                                         \
    template void router_topk<T>(const T*, const T*, int64_t, int64_t, int64_t, int64_t, bool, \
                                 double, T*, int32_t*, T*);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
