#include "sparsetron/perf/flops.h"

#include <algorithm>
#include <cmath>

namespace sparsetron {
namespace {

// The dimensions both conventions read. Layer kinds: MTP depths count as layers of the last
// backbone layer's kind.
struct Dims {
    double n_dense = 0, n_moe = 0, k, Fm, Fs, ffn, qr, kr, dn, dr, dv;
};
Dims dims_of(const ModelConfig& m) {
    Dims d;
    for (int64_t l = 0; l < m.num_layers; ++l) (m.is_moe_layer(l) ? d.n_moe : d.n_dense) += 1;
    (m.is_moe_layer(m.num_layers - 1) ? d.n_moe : d.n_dense) += double(m.mtp_num_layers);
    d.k = double(m.moe_router_topk), d.Fm = double(m.moe_ffn_hidden_size);
    d.Fs = double(m.moe_shared_expert_intermediate_size), d.ffn = double(m.ffn_hidden_size);
    d.qr = double(m.q_lora_rank), d.kr = double(m.kv_lora_rank), d.dn = double(m.qk_head_dim);
    d.dr = double(m.qk_pos_emb_head_dim), d.dv = double(m.v_head_dim);
    return d;
}

}  // namespace

const char* FlopCount::convention() {
    return "SPEC §8: 2 FLOPs per multiply-add, trained GEMMs 3x forward, real tokens only, "
           "attention over the DSA top-k pairs, indexer scores over all causal pairs";
}

FlopCount audited_flops(const ModelConfig& m, const std::vector<int64_t>& docs) {
    const double h = double(m.hidden_size), V = double(m.vocab_size),
                 H = double(m.num_attention_heads);
    const int64_t L = m.num_layers, D = m.mtp_num_layers;
    double T = 0, p_dense = 0, p_sparse = 0;
    const bool dsa = m.uses_dsa();
    const int64_t topk = dsa ? m.dsa_indexer_topk : INT64_MAX;
    for (int64_t n : docs) {
        T += double(n);
        p_dense += double(n) * double(n + 1) / 2;
        // Σ_{j=1..n} min(j, topk)
        const int64_t a = std::min(n, topk);
        p_sparse +=
            double(a) * double(a + 1) / 2 + double(n - a) * double(topk == INT64_MAX ? 0 : topk);
    }
    const Dims d = dims_of(m);
    const double n_dense = d.n_dense, n_moe = d.n_moe, k = d.k, Fm = d.Fm, Fs = d.Fs, ffn = d.ffn,
                 qr = d.qr, kr = d.kr, dn = d.dn, dr = d.dr, dv = d.dv;
    const bool kvshare = D > 0 && dsa && m.dsa_mtp_index_kv_share;
    FlopCount f;
    f.tokens = int64_t(T);
    auto add = [&](const char* name, double v) {
        f.terms.emplace_back(name, v);
        f.total += v;
    };
    add("mlp", 6 * T * h * (3 * ffn * n_dense + 3 * (k * Fm + Fs) * n_moe));
    const double q_term = qr * (h + H * (dn + dr) + 1),
                 kv_term = kr * (h + H * (dn + dv) + 1) + h * dr, o_term = H * dv * h;
    add("attention_projections",
        6 * T *
            (double(L + D) * (q_term + kv_term + o_term) -
             double(std::max<int64_t>(D - 1, 0)) * (kvshare ? 1 : 0) * (kr * h + h * dr + kr)));
    add("mtp_projections", 6 * T * double(D) * (3 * h + 2 * h * h));
    const bool tv = m.mtp_loss_type == "e2e_tv";
    add("output_heads",
        2 * T * h * V * (3 + (m.mtp_detach_heads ? 2 : 3) * double(D) + (tv && D > 0 ? 1 : 0)));
    add("attention_core", 6 * double(L + D) * H * (2 * kr + dr) * (dsa ? p_sparse : p_dense));
    if (dsa) {
        int64_t n_idx = 0;
        for (int64_t l = 0; l < L; ++l) n_idx += dsa_layer_is_full(m, l);
        if (D > 0) n_idx += kvshare ? 1 : D;  // the MTP layer computes its own (SPEC §3.3)
        const bool loss = m.dsa_indexer_loss_coeff > 0;
        const double HI = double(m.dsa_indexer_n_heads), dI = double(m.dsa_indexer_head_dim);
        add("indexer",
            double(n_idx) *
                ((loss ? 4 : 2) * T * (qr * HI * dI + h * dI + h * HI) + 2 * HI * dI * p_dense +
                 (loss ? 4 * HI * dI * (m.dsa_indexer_use_sparse_loss ? p_sparse : p_dense) : 0)));
    }
    return f;
}

FlopCount megatron_flops(const ModelConfig& m, const std::vector<int64_t>& docs) {
    const double h = double(m.hidden_size), V = double(m.vocab_size),
                 H = double(m.num_attention_heads);
    const int64_t L = m.num_layers, D = m.mtp_num_layers;
    double T = 0, S2 = 0;
    for (int64_t n : docs) T += double(n), S2 += double(n) * double(n);
    const Dims d = dims_of(m);
    const double n_dense = d.n_dense, n_moe = d.n_moe, k = d.k, Fm = d.Fm, Fs = d.Fs, ffn = d.ffn,
                 qr = d.qr, kr = d.kr, dn = d.dn, dr = d.dr, dv = d.dv;
    const double n_att = double(L + D);
    FlopCount f;
    f.tokens = int64_t(T);
    auto add = [&](const char* name, double v) {
        f.terms.emplace_back(name, v);
        f.total += v;
    };
    add("mlp", T * 6 * h * (3 * ffn * n_dense + 3 * (k * Fm + Fs) * n_moe));
    const double q_term = qr * (h + H * (dn + dr) + 1),
                 kv_term = kr * (h + H * (dn + dv) + 1) + h * dr, o_term = H * dv * h;
    add("attention_projections", T * 6 * n_att * (q_term + kv_term + o_term));
    add("mtp_projections", T * 6 * double(D) * (3 * h + 2 * h * h));
    add("output_heads",
        T * (6 * h * V * double(D + 1) + (m.mtp_loss_type == "e2e_tv" ? 2 * h * V : 0)));
    const double lbar = T > 0 ? S2 / T : 0;
    double scale = 1;
    if (m.uses_dsa() && lbar > 0) {
        const double eff = std::min(double(m.dsa_indexer_topk), std::floor(lbar));
        scale = eff * (1 - eff / (2 * lbar)) / (lbar / 2);
    }
    add("attention_core", S2 * 6 * (H * (kr + dr) / 2 + H * kr / 2) * scale * n_att);
    if (m.uses_dsa()) {
        // Megatron's rule on layer numbers 1..L+D: skip iff max(l - max(off, 1), 0) % f != 0.
        int64_t n_idx = 0;
        const int64_t off = std::max<int64_t>(m.dsa_indexer_skip_topk_offset, 1);
        for (int64_t l = 1; l <= L + D; ++l)
            n_idx += (std::max<int64_t>(l - off, 0) % m.dsa_indexer_topk_freq) == 0;
        const bool loss = m.dsa_indexer_loss_coeff > 0;
        const double HI = double(m.dsa_indexer_n_heads), dI = double(m.dsa_indexer_head_dim);
        add("indexer", T * (loss ? 2 : 1) * 2 * double(n_idx) * (qr * HI * dI + h * dI + h * HI) +
                           S2 * (loss ? 3 : 1) * 2 * double(n_idx) * HI * dI / 2);
    }
    return f;
}

}  // namespace sparsetron
