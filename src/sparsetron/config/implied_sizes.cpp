#include "sparsetron/config/implied_sizes.h"

#include <initializer_list>
#include <string>
#include <utility>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

using Factor = std::pair<const char*, int64_t>;

// The product of the factors (a name is a recipe key, or a description of a derived count);
// throws naming them when it overflows or passes kMaxElements.
int64_t product(const char* what, std::initializer_list<Factor> factors) {
    int64_t p = 1;
    bool over = false;
    for (const auto& [name, v] : factors) over = over || __builtin_mul_overflow(p, v, &p);
    if (!over && p <= kMaxElements) return p;
    std::string names, values;
    for (const auto& [name, v] : factors) {
        names += (names.empty() ? "" : " x ") + std::string(name);
        values += (values.empty() ? "" : " x ") + std::to_string(v);
    }
    throw Error(cat("recipe keys ", names, " (", values, ") imply ", what, " of more than 2^50 ",
                    "elements, beyond what any machine holds: check those values"));
}

int64_t sum(const char* what, std::initializer_list<int64_t> terms) {
    int64_t s = 0;
    for (int64_t t : terms)
        ST_CHECK(!__builtin_add_overflow(s, t, &s) && s <= kMaxElements, "the recipe implies ",
                 what, " of more than 2^50 elements: check the model's sizes");
    return s;
}

}  // namespace

void check_implied_sizes(const ModelConfig& m, const RunConfig& r) {
    const int64_t heads = m.num_attention_heads, h = m.hidden_size;
    // Tokens: a micro-batch's, a step's.
    const int64_t tokens = product(
        "a micro-batch", {{"seq_length", r.seq_length}, {"micro_batch_size", r.micro_batch_size}});
    product("a step", {{"seq_length", r.seq_length}, {"global_batch_size", r.global_batch_size}});
    // Weights of one layer, and the model's total.
    const int64_t embedding =
        product("the embedding", {{"vocab_size", m.vocab_size}, {"hidden_size", h}});
    const int64_t q_width =
        product("the query heads",
                {{"num_attention_heads", heads},
                 {"qk_head_dim + qk_pos_emb_head_dim", m.qk_head_dim + m.qk_pos_emb_head_dim}});
    const int64_t kv_width = product("the key/value heads",
                                     {{"num_attention_heads", heads},
                                      {"qk_head_dim + v_head_dim", m.qk_head_dim + m.v_head_dim}});
    const int64_t attention = sum(
        "an attention layer's weights",
        {product("q_a_proj", {{"hidden_size", h}, {"q_lora_rank", m.q_lora_rank}}),
         product("q_b_proj", {{"q_lora_rank", m.q_lora_rank}, {"attention heads' width", q_width}}),
         product("kv_a_proj",
                 {{"hidden_size", h},
                  {"kv_lora_rank + qk_pos_emb_head_dim", m.kv_lora_rank + m.qk_pos_emb_head_dim}}),
         product("kv_b_proj", {{"kv_lora_rank", m.kv_lora_rank}, {"key/value width", kv_width}}),
         product("o_proj", {{"num_attention_heads x v_head_dim",
                             product("o_proj", {{"num_attention_heads", heads},
                                                {"v_head_dim", m.v_head_dim}})},
                            {"hidden_size", h}})});
    const int64_t indexer =
        m.uses_dsa() ? product("the indexer's query projection",
                               {{"q_lora_rank", m.q_lora_rank},
                                {"dsa_indexer_n_heads x dsa_indexer_head_dim",
                                 product("the indexer's heads",
                                         {{"dsa_indexer_n_heads", m.dsa_indexer_n_heads},
                                          {"dsa_indexer_head_dim", m.dsa_indexer_head_dim}})}})
                     : 0;
    const int64_t dense = product(
        "a dense MLP", {{"3 x hidden_size", 3 * h}, {"ffn_hidden_size", m.ffn_hidden_size}});
    const int64_t experts =
        product("a layer's routed experts", {{"num_experts", m.num_experts},
                                             {"3 x hidden_size", 3 * h},
                                             {"moe_ffn_hidden_size", m.moe_ffn_hidden_size}});
    const int64_t shared =
        product("the shared expert",
                {{"3 x hidden_size", 3 * h},
                 {"moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size}});
    const int64_t layers = m.num_layers + m.mtp_num_layers;
    const int64_t moe_layer = sum("an MoE layer's weights", {attention, indexer, experts, shared});
    const int64_t dense_layer = sum("a dense layer's weights", {attention, indexer, dense});
    sum("the model's parameters",
        {product("the MoE layers",
                 {{"num_layers + mtp_num_layers", layers}, {"an MoE layer's weights", moe_layer}}),
         product("the dense layers", {{"num_layers + mtp_num_layers", layers},
                                      {"a dense layer's weights", dense_layer}}),
         2 * embedding});
    // A micro-batch's activations: the widest per-token rows.
    product("the hidden states", {{"seq_length x micro_batch_size", tokens}, {"hidden_size", h}});
    product("the logits",
            {{"seq_length x micro_batch_size", tokens}, {"vocab_size", m.vocab_size}});
    product("the attention's queries",
            {{"seq_length x micro_batch_size", tokens}, {"query width", q_width}});
    product("the attention's keys and values",
            {{"seq_length x micro_batch_size", tokens}, {"key/value width", kv_width}});
    product("the dense MLP's activations",
            {{"seq_length x micro_batch_size", tokens}, {"ffn_hidden_size", m.ffn_hidden_size}});
    product("the routed experts' activations", {{"seq_length x micro_batch_size", tokens},
                                                {"moe_router_topk", m.moe_router_topk},
                                                {"moe_ffn_hidden_size", m.moe_ffn_hidden_size}});
    product("the router's scores",
            {{"seq_length x micro_batch_size", tokens}, {"num_experts", m.num_experts}});
    if (m.uses_dsa()) {
        product("the sparse attention's selected keys", {{"seq_length x micro_batch_size", tokens},
                                                         {"num_attention_heads", heads},
                                                         {"dsa_indexer_topk", m.dsa_indexer_topk}});
        product("the indexer's scores", {{"seq_length x micro_batch_size", tokens},
                                         {"dsa_indexer_n_heads", m.dsa_indexer_n_heads},
                                         {"dsa_indexer_query_block", m.dsa_indexer_query_block}});
        product("the indexer's keys", {{"seq_length x micro_batch_size", tokens},
                                       {"dsa_indexer_head_dim", m.dsa_indexer_head_dim}});
    }
}

}  // namespace sparsetron
