// DSA top-k and MoE routing properties that the gradient checks do not pin down.
#include <gtest/gtest.h>

#include <cmath>

#include "sparsetron/core/rng.h"
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/model/param_table.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

ModelConfig base() {
    ModelConfig m;
    m.num_layers = 1;
    m.hidden_size = 16;
    m.num_attention_heads = 2;
    m.q_lora_rank = 8;
    m.kv_lora_rank = 8;
    m.qk_head_dim = 4;
    m.qk_pos_emb_head_dim = 2;
    m.v_head_dim = 4;
    m.ffn_hidden_size = 8;
    m.vocab_size = 20;
    m.moe_layer_pattern = {1};
    m.num_experts = 4;
    m.moe_ffn_hidden_size = 4;
    m.moe_router_topk = 2;
    return m;
}

}  // namespace

TEST(Components, DsaTopkIsAscendingPaddedAndCausal) {
    ModelConfig m = base();
    m.moe_layer_pattern = {0};
    m.experimental_attention_variant = "dsa";
    m.dsa_indexer_n_heads = 2;
    m.dsa_indexer_head_dim = 4;
    m.dsa_indexer_topk = 3;
    MemoryPlan plan;
    Buffers buf(plan, DType::F64);
    ParamStore store(plan, DType::F64);
    add_decoder_layer_params(m, store, 0);
    DecoderLayer<double> layer(m, store, buf, 0, 12);
    auto slots = layer.declare_acts(buf, "l.");
    plan.allocate(Device::CPU);
    std::vector<double*> p, g;
    for (const auto& e : store.params()) {
        p.push_back(buf.ptr<double>(e.param_slot));
        g.push_back(buf.ptr<double>(e.grad_slot));
    }
    store.initialize(plan, 3, 0.5, 1);
    layer.bind(buf, p, g);
    auto A = layer.resolve(buf, slots);
    std::vector<int32_t> pos = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0}, cu = {0, 5, 11, 11};
    std::vector<int32_t> tok(12, 1);
    StepInputs in{12, tok.data(), pos.data(), cu.data(), 2};
    auto x = test::random_vector<double>(12 * 16, 9);
    std::vector<double> out(12 * 16);
    layer.forward(A, x.data(), out.data(), in, 0.0, 0.0);
    for (int64_t t = 0; t < 12; ++t) {
        const int64_t doc = t < 5 ? 0 : t < 11 ? 1 : -1;
        const int64_t begin = doc == 0 ? 0 : 5, valid = doc < 0 ? 0 : t - begin + 1;
        EXPECT_EQ(A.topk_len[t], std::min<int64_t>(3, valid)) << t;
        for (int64_t j = 0; j < 3; ++j) {
            int32_t s = A.topk[t * 3 + j];
            if (j >= A.topk_len[t]) {
                EXPECT_EQ(s, -1);
                continue;
            }
            EXPECT_GE(s, begin) << "crosses into an earlier document";
            EXPECT_LE(s, t) << "not causal";
            if (j > 0) {
                EXPECT_GT(s, A.topk[t * 3 + j - 1]) << "not ascending";
            }
        }
    }
}

TEST(Components, MoeForceBalanceCapacityAndBiasUpdate) {
    for (bool force : {true, false}) {
        ModelConfig m = base();
        m.moe_router_force_load_balancing = force;
        m.moe_capacity_factor = force ? 0.0 : 0.5;
        MemoryPlan plan;
        Buffers buf(plan, DType::F64);
        ParamStore store(plan, DType::F64);
        add_moe_params(m, store, "mlp.");
        MoeLayer<double> moe(m, store, buf, "mlp.", 16);
        auto slots = moe.declare_acts(buf, "moe.");
        plan.allocate(Device::CPU);
        std::vector<double*> p, g;
        for (const auto& e : store.params()) {
            p.push_back(buf.ptr<double>(e.param_slot));
            g.push_back(e.grad_slot < 0 ? nullptr : buf.ptr<double>(e.grad_slot));
        }
        store.initialize(plan, 4, 0.5, 1);
        moe.bind(buf, p, g);
        auto A = moe.resolve(buf, slots);
        std::vector<int32_t> pos(16, 0), cu = {0, 14};  // two padding rows
        StepInputs in{16, nullptr, pos.data(), cu.data(), 1};
        auto x = test::random_vector<double>(16 * 16, 2);
        std::vector<double> y(16 * 16, 0.0);
        moe.forward(A, x.data(), in, y.data(), 0.0);
        int64_t routed = 0;
        for (int64_t l : moe.stats().load) routed += l;
        EXPECT_EQ(routed, 14 * 2);  // padding rows are not routed
        if (force) {
            EXPECT_EQ(moe.stats().load, (std::vector<int64_t>{7, 7, 7, 7}));
            EXPECT_EQ(moe.stats().dropped, 0);
        } else {
            // Capacity ceil(0.5 * 16 * 2 / 4) = 4 rows per expert: the rest is dropped and counted.
            EXPECT_EQ(moe.capacity(), 4);
            int64_t over = 0;
            for (int64_t l : moe.stats().load) over += std::max<int64_t>(0, l - 4);
            EXPECT_EQ(moe.stats().dropped, over);
            EXPECT_GT(over, 0);
        }
        // Aux-loss-free balancing: overloaded experts' bias goes down, underloaded up.
        const int64_t bias = store.index_of("mlp.gate.e_score_correction_bias");
        moe.stats().load = {10, 2, 6, 6};
        moe.update_bias(0.01);
        EXPECT_DOUBLE_EQ(p[bias][0], -0.01);
        EXPECT_DOUBLE_EQ(p[bias][1], 0.01);
        EXPECT_DOUBLE_EQ(p[bias][2], 0.0);
    }
}

// The expert-parallel receive bound the plan sizes its buffers by (ModelConfig::
// moe_ep_received_rows): routings that reach it exist, and no routing the rules allow exceeds
// it. A token picks k distinct experts; with force-balanced routing token t's j-th pick is
// (t k + j) mod E; with a capacity an expert keeps at most that many rows from a source.
TEST(Components, ExpertParallelReceiveBoundHoldsAndIsReached) {
    ModelConfig m = base();
    for (int64_t E : {4, 8, 64})
        for (int64_t W : {2, 4, 16}) {
            if (E % W != 0 || W > E) continue;
            m.num_experts = E, m.expert_parallel_ranks = W, m.moe_router_topk = E >= 8 ? 8 : 2;
            const int64_t T = 96, k = m.moe_router_topk, El = E / W;
            // Rows rank 0 gets from one source for a routing (topk[t * k + j]), capacity applied.
            auto to_rank0 = [&](const std::vector<int64_t>& topk, int64_t cap) {
                std::vector<int64_t> per_expert(static_cast<size_t>(E), 0);
                for (int64_t e : topk) ++per_expert[size_t(e)];
                int64_t rows = 0;
                for (int64_t e = 0; e < El; ++e) rows += std::min(per_expert[size_t(e)], cap);
                return rows;
            };
            // Dropless: every token sends as many of its k picks as rank 0 has experts.
            m.moe_capacity_factor = 0, m.moe_router_force_load_balancing = false;
            std::vector<int64_t> adversarial;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < k; ++j) adversarial.push_back(j);  // experts 0..k-1
            const int64_t dropless = m.moe_ep_received_rows(T);
            EXPECT_EQ(W * to_rank0(adversarial, T), dropless) << E << " experts, EP " << W;
            CounterRng rng(uint64_t(E * 100 + W), 3);
            for (int trial = 0; trial < 20; ++trial) {
                std::vector<int64_t> topk;
                for (int64_t t = 0; t < T; ++t) {
                    std::vector<int64_t> all(static_cast<size_t>(E));
                    for (int64_t e = 0; e < E; ++e) all[size_t(e)] = e;
                    for (int64_t j = 0; j < k; ++j) {  // k distinct experts
                        const int64_t pick =
                            j + int64_t(rng.bits(uint64_t(trial * 100000 + t * 64 + j)) %
                                        uint64_t(E - j));
                        std::swap(all[size_t(j)], all[size_t(pick)]);
                        topk.push_back(all[size_t(j)]);
                    }
                }
                EXPECT_LE(W * to_rank0(topk, T), dropless);
            }
            // Force-balanced: the bound is the rows the rule sends (about T k, not W T k).
            m.moe_router_force_load_balancing = true;
            std::vector<int64_t> forced;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < k; ++j) forced.push_back((t * k + j) % E);
            EXPECT_EQ(W * to_rank0(forced, T), m.moe_ep_received_rows(T)) << E << ", EP " << W;
            EXPECT_LE(m.moe_ep_received_rows(T), T * k + W * El);
            // Capacity: kept rows per expert and source at most the capacity; a routing that
            // spreads every token's picks over rank 0's experts fills them all to it.
            m.moe_router_force_load_balancing = false, m.moe_capacity_factor = 1.0;
            const int64_t cap = m.moe_expert_capacity(T), local = std::min(k, El);
            std::vector<int64_t> spread;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < k; ++j)
                    spread.push_back(j < local ? (t * local + j) % El : El + (j - local));
            EXPECT_EQ(W * to_rank0(spread, cap), m.moe_ep_received_rows(T)) << E << ", EP " << W;
        }
    // The seed's 16-GPU proxy (64 experts, EP 16, top-8, 4096 tokens): 524,288 received rows
    // would be W x tokens x k; dropless routing bounds them at 262,144, force-balanced at 32,768.
    m.num_experts = 64, m.expert_parallel_ranks = 16, m.moe_router_topk = 8;
    m.moe_capacity_factor = 0, m.moe_router_force_load_balancing = false;
    EXPECT_EQ(m.moe_ep_received_rows(4096), 262144);
    m.moe_router_force_load_balancing = true;
    EXPECT_EQ(m.moe_ep_received_rows(4096), 32768);
}

// The receive budget (moe_expert_rank_capacity_factor): W x a per-pair share of factor x tokens x
// k, rounded up to 16 rows, never above the dropless bound; and the redo's chunk: the most tokens
// whose dropless rows (without force balancing's rule: a chunk of a balanced micro-batch need not
// be balanced) fit the budget.
TEST(Components, ExpertParallelReceiveBudgetAndRedoChunks) {
    ModelConfig m = base();
    m.num_experts = 64, m.expert_parallel_ranks = 16, m.moe_router_topk = 8;
    const int64_t T = 6144, k = 8, W = 16, El = 4;
    m.moe_expert_rank_capacity_factor = 0;
    EXPECT_EQ(m.moe_ep_received_rows(T), m.moe_ep_dropless_rows(T));
    EXPECT_EQ(m.moe_ep_redo_chunk_tokens(T), T) << "dropless: one chunk";
    for (double f : {0.5, 1.0, 1.2, 2.0}) {
        m.moe_expert_rank_capacity_factor = f;
        const int64_t budget = m.moe_ep_received_rows(T);
        const int64_t pair = (int64_t(std::ceil(f * double(T * k) / double(W))) + 15) / 16 * 16;
        EXPECT_EQ(budget, W * pair) << f;
        EXPECT_LT(budget, m.moe_ep_dropless_rows(T)) << f;
        const int64_t c = m.moe_ep_redo_chunk_tokens(T);
        auto dropless = [&](int64_t t) { return W * std::min(t * k, El * t); };
        EXPECT_LE(dropless(c), budget) << f;
        EXPECT_GT(dropless(c + 1), budget) << f;
    }
    // A factor of 1.2 plans 6.7x fewer rows than the dropless bound on the seed's 16-GPU recipe
    // (6144 rows per rank); the redo then runs 7 chunks of 924 tokens.
    m.moe_expert_rank_capacity_factor = 1.2;
    EXPECT_EQ(m.moe_ep_received_rows(T), 59136);
    EXPECT_EQ(m.moe_ep_dropless_rows(T), 393216);
    EXPECT_EQ((T + m.moe_ep_redo_chunk_tokens(T) - 1) / m.moe_ep_redo_chunk_tokens(T), 7);
    // A budget below what one token sends one owner still holds a token.
    m.moe_expert_rank_capacity_factor = 1e-6;
    EXPECT_EQ(m.moe_ep_received_rows(T), W * 16);
    EXPECT_GE(m.moe_ep_redo_chunk_tokens(T), 1);
    EXPECT_LE(W * std::min(k, El) * m.moe_ep_redo_chunk_tokens(T), m.moe_ep_received_rows(T));
    // Without expert parallelism the budget does nothing.
    m.expert_parallel_ranks = 1;
    EXPECT_EQ(m.moe_ep_received_rows(T), m.moe_ep_dropless_rows(T));
}
