#include "sparsetron/config/model_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "sparsetron/core/error.h"

namespace sparsetron {

int64_t ModelConfig::num_moe_layers() const {
    int64_t n = 0;
    for (int v : moe_layer_pattern) n += v;
    return n;
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(moe_layer_pattern.size()) &&
           moe_layer_pattern[layer] != 0;
}

int64_t ModelConfig::moe_expert_capacity(int64_t tokens) const {
    if (moe_capacity_factor <= 0) return tokens;
    return std::min<int64_t>(
        tokens, static_cast<int64_t>(std::ceil(moe_capacity_factor * double(tokens) *
                                               double(moe_router_topk) / double(num_experts))));
}

int64_t ModelConfig::moe_rows_per_expert_from_one_source(int64_t tokens) const {
    int64_t rows = moe_expert_capacity(tokens);
    if (moe_router_force_load_balancing)
        rows = std::min(rows, (tokens * moe_router_topk + num_experts - 1) / num_experts);
    return rows;
}

int64_t ModelConfig::moe_ep_dropless_rows(int64_t tokens) const {
    // A source sends at most tokens x k rows in all, and at most the per-expert bound to each of
    // the rank's experts.
    const int64_t per_source = std::min(
        tokens * moe_router_topk, local_experts() * moe_rows_per_expert_from_one_source(tokens));
    return expert_parallel_ranks * per_source;
}

int64_t ModelConfig::moe_ep_received_rows(int64_t tokens) const {
    const int64_t dropless = moe_ep_dropless_rows(tokens);
    if (moe_expert_rank_capacity_factor <= 0 || expert_parallel_ranks <= 1) return dropless;
    // The budget per (source, owner) pair, rounded up to 16 rows, and at least what one token
    // can send one owner (so the redo's chunks hold a token).
    const double share = moe_expert_rank_capacity_factor * double(tokens) *
                         double(moe_router_topk) / double(expert_parallel_ranks);
    const int64_t pair =
        std::max<int64_t>(int64_t(std::ceil(share)), std::min(moe_router_topk, local_experts()));
    return std::min(dropless, expert_parallel_ranks * ((pair + 15) / 16 * 16));
}

int64_t ModelConfig::moe_ep_redo_chunk_tokens(int64_t tokens) const {
    // Chunks are routed without force balancing's bound (a chunk of a balanced micro-batch
    // need not be balanced): at most k rows per token, at most one per token to each expert.
    const int64_t budget = moe_ep_received_rows(tokens);
    const auto dropless = [&](int64_t t) {
        return expert_parallel_ranks * std::min(t * moe_router_topk, local_experts() * t);
    };
    int64_t lo = 1, hi = tokens;  // dropless(1) fits: the budget holds one token's rows
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (dropless(mid) <= budget)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

void require_dsa_for_context_parallel(const ModelConfig& c) {
    ST_CHECK(
        c.uses_dsa(),
        "context parallelism is implemented for DSA attention (experimental_attention_variant: "
        "dsa); this model attends densely");
}

ActivationPolicy ModelConfig::activation() const {
    return ActivationPolicy::parse(recompute_granularity, recompute_modules,
                                   fine_grained_activation_offloading, offload_modules);
}

bool dsa_layer_is_full(const ModelConfig& c, int64_t layer0) {
    if (layer0 >= c.num_layers) return true;  // an MTP block's layer 1
    if (!c.indexer_types.empty() && layer0 < static_cast<int64_t>(c.indexer_types.size()))
        return c.indexer_types[layer0] == "full";
    const int64_t l = layer0 + 1, o = std::max<int64_t>(c.dsa_indexer_skip_topk_offset, 1);
    return std::max<int64_t>(l - o, 0) % c.dsa_indexer_topk_freq == 0;
}

int64_t dsa_source_layer(const ModelConfig& c, int64_t layer0) {
    if (dsa_layer_is_full(c, layer0)) return layer0;
    if (!c.indexer_types.empty() && layer0 < static_cast<int64_t>(c.indexer_types.size())) {
        for (int64_t s = layer0 - 1; s >= 0; --s)
            if (c.indexer_types[s] == "full") return s;
        throw Error(
            cat("indexer_types: layer ", layer0, " is shared but no earlier layer is full"));
    }
    const int64_t l = layer0 + 1, o = std::max<int64_t>(c.dsa_indexer_skip_topk_offset, 1);
    return l - ((l - o) % c.dsa_indexer_topk_freq) - 1;
}

void check_index_share_pipeline_split(const ModelConfig& c,
                                      const std::vector<int64_t>& stage_layers) {
    if (!c.uses_dsa() || stage_layers.size() < 2) return;
    int64_t first = 0;
    for (size_t s = 0; s < stage_layers.size(); ++s) {
        if (s > 0 && stage_layers[s] > 0 && !dsa_layer_is_full(c, first)) {
            const int64_t src = dsa_source_layer(c, first);
            throw Error(cat(
                "DSA IndexShare pipeline split is invalid: pipeline stage ", s, " starts on layer ",
                first + 1, " (1-based), a shared layer whose top-k comes from layer ", src + 1,
                " on an earlier stage; as in Megatron, top-k is not carried across stages, so "
                "every stage must start on a layer that computes its own indexer "
                "(dsa_indexer_topk_freq ",
                c.dsa_indexer_topk_freq, ", dsa_indexer_skip_topk_offset ",
                c.dsa_indexer_skip_topk_offset,
                "): move the stage boundary (decoder_first/last_pipeline_num_layers or "
                "pipeline_model_parallel_layout) or change the offset"));
        }
        first += stage_layers[s];
    }
}

namespace {

// Recursive-descent parser for: expr := term ('+' term)* ; term := atom ('*' int)? ;
// atom := '[' int (',' int)* ']' | '(' expr ')'.
class FreqParser {
  public:
    explicit FreqParser(const std::string& s) : s_(s) {}

    std::vector<int> parse() {
        std::vector<int> v = expr();
        skip();
        if (pos_ != s_.size()) fail("unexpected trailing text");
        return v;
    }

  private:
    [[noreturn]] void fail(const std::string& what) {
        throw Error(cat("moe_layer_freq: cannot parse \"", s_, "\" at position ", pos_, ": ", what,
                        " (expected an int, a list like [0,1,1], or an expression like "
                        "([0]*2+[1]*19))"));
    }
    void skip() {
        while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
    }
    bool eat(char c) {
        skip();
        if (pos_ < s_.size() && s_[pos_] == c) return ++pos_, true;
        return false;
    }
    long integer() {
        skip();
        size_t start = pos_;
        while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
        if (start == pos_) fail("expected a non-negative integer");
        if (pos_ - start > 6) fail("integer too large");
        return std::stol(s_.substr(start, pos_ - start));
    }
    std::vector<int> expr() {
        std::vector<int> v = term();
        while (eat('+')) {
            auto t = term();
            v.insert(v.end(), t.begin(), t.end());
        }
        return v;
    }
    std::vector<int> term() {
        std::vector<int> a = atom();
        if (eat('*')) {
            long n = integer();
            std::vector<int> r;
            for (long i = 0; i < n; ++i) r.insert(r.end(), a.begin(), a.end());
            return r;
        }
        return a;
    }
    std::vector<int> atom() {
        if (eat('(')) {
            auto v = expr();
            if (!eat(')')) fail("expected ')'");
            return v;
        }
        if (eat('[')) {
            std::vector<int> v;
            if (eat(']')) return v;
            do {
                long x = integer();
                if (x != 0 && x != 1) fail("list entries must be 0 (dense) or 1 (MoE)");
                v.push_back(static_cast<int>(x));
            } while (eat(','));
            if (!eat(']')) fail("expected ']'");
            return v;
        }
        fail("expected '[' or '('");
    }

    const std::string& s_;
    size_t pos_ = 0;
};

}  // namespace

std::vector<int> parse_moe_layer_freq(const std::string& expr, int64_t num_layers) {
    size_t first = expr.find_first_not_of(" \t");
    if (first == std::string::npos) return std::vector<int>(num_layers, 0);
    if (std::isdigit(static_cast<unsigned char>(expr[first]))) {
        size_t used = 0;
        long n = 0;
        try {
            n = std::stol(expr, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (expr.find_first_not_of(" \t", used) != std::string::npos || n <= 0)
            throw Error(cat("moe_layer_freq: \"", expr,
                            "\" is not a positive int, a list, or a list expression"));
        std::vector<int> v(num_layers);
        for (int64_t i = 0; i < num_layers; ++i) v[i] = (i % n == 0) ? 1 : 0;
        return v;
    }
    std::vector<int> v = FreqParser(expr).parse();
    ST_CHECK(static_cast<int64_t>(v.size()) == num_layers, "moe_layer_freq: \"", expr,
             "\" describes ", v.size(), " layers but num_layers is ", num_layers);
    return v;
}

}  // namespace sparsetron
