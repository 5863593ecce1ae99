#include "sparsetron/optim/muon.h"

#include <algorithm>
#include <cmath>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/optim/optim.h"

namespace sparsetron {

int64_t MuonSlice::num_rows() const {
    int64_t n = 0;
    for (auto [b, e] : rows) n += e - b;
    return n;
}

namespace {

using Coeff = MuonCoefficients;

Coeff coefficients_at(const std::string& type, int64_t step) {
    static const Coeff quintic[5] = {{4.0848, -6.8946, 2.9270},
                                     {3.9505, -6.3029, 2.6377},
                                     {3.7418, -5.5913, 2.3037},
                                     {2.8769, -3.1427, 1.2046},
                                     {2.8366, -3.0525, 1.2012}};
    if (type == "simple") return {3.4445, -4.7750, 2.0315};
    return quintic[std::min<int64_t>(step, 4)];  // steps past the fifth reuse the last tuple
}

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() &&
           s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

MuonCoefficients muon_ns_coefficients(const std::string& type, int64_t step) {
    return coefficients_at(type, step);
}

NewtonSchulzCount newton_schulz_count(const std::vector<MuonSplit>& splits,
                                      const std::vector<std::vector<int64_t>>& shapes,
                                      const RunConfig& r) {
    NewtonSchulzCount n;
    const int64_t steps = r.muon_num_ns_steps;
    for (size_t i = 0; i < splits.size(); ++i)
        for (const MuonSlice& s : splits[i].slices) {
            const int64_t rows = s.num_rows(), cols = shapes[i][1];
            const int64_t lo = std::min(rows, cols), hi = std::max(rows, cols);
            const bool gram = uses_gram_ns(r.muon_ns_method, lo, hi, steps);
            n.standard_flops += 2 * newton_schulz_cost(lo, hi, steps);
            n.chosen_flops += 2 * newton_schulz_cost(lo, hi, steps, gram);
            n.matrices += 1;
            n.gram_matrices += gram ? 1 : 0;
        }
    return n;
}

NewtonSchulzCount newton_schulz_count(const ParamStore& store, const ModelConfig& m,
                                      const RunConfig& r) {
    if (r.optimizer != "muon") return {};
    std::vector<MuonSplit> splits;
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& p : store.params()) {
        splits.push_back(is_muon_param(p) ? muon_split_for(p, m, r) : MuonSplit{});
        shapes.push_back(p.shape);
    }
    return newton_schulz_count(splits, shapes, r);
}

double muon_scale(int64_t m, int64_t n, const std::string& mode) {
    if (mode == "shape_scaling") return std::sqrt(std::max(1.0, double(m) / double(n)));
    if (mode == "unit_rms_norm") return std::sqrt(double(m) / double(n));
    return std::sqrt(double(std::max(m, n)));  // spectral
}

MuonSplit muon_split_for(const ParamInfo& p, const ModelConfig& m, const RunConfig& r) {
    MuonSplit s;
    const bool q_b = ends_with(p.name, "self_attn.q_b_proj.weight");
    const bool kv_b = ends_with(p.name, "self_attn.kv_b_proj.weight");
    if (!(q_b || kv_b) || !(r.muon_split_qkv || r.muon_split_qkv_per_head)) {
        s.slices.push_back({{{0, p.shape[0]}}});
        return s;
    }
    // Per head: q_b rows [nope | rope], kv_b rows [k_nope | v].
    const int64_t first = m.qk_head_dim, second = q_b ? m.qk_pos_emb_head_dim : m.v_head_dim;
    const int64_t H = m.num_attention_heads, per = first + second;
    if (r.muon_split_qkv_per_head) {
        s.kind = "per_head";
        for (int64_t h = 0; h < H; ++h) {
            s.slices.push_back({{{h * per, h * per + first}}});
            s.slices.push_back({{{h * per + first, (h + 1) * per}}});
        }
    } else {
        s.kind = "per_projection";
        MuonSlice a, b;
        for (int64_t h = 0; h < H; ++h) {
            a.rows.push_back({h * per, h * per + first});
            b.rows.push_back({h * per + first, (h + 1) * per});
        }
        s.slices = {a, b};
    }
    return s;
}

Muon::Muon(const ParamStore& store, MemoryPlan& plan, const ModelConfig& m, const RunConfig& r)
    : store_(store) {
    for (const auto& p : store.params()) {
        const bool muon = is_muon_param(p);
        momentum_.push_back(muon ? plan.add(MemClass::OptimizerState, p.name + ".momentum_buffer",
                                            store.dtype(), p.shape)
                                 : -1);
        splits_.push_back(muon ? muon_split_for(p, m, r) : MuonSplit{});
    }
}

void Muon::step(const MemoryPlan& plan, const RunConfig& r, double lr, double grad_scale,
                const std::vector<bool>* update) {
    const auto& params = store_.params();
    auto run = [&](auto zero) {
        using T = decltype(zero);
        std::vector<T> slice, ws;
        for (size_t i = 0; i < params.size(); ++i) {
            if (momentum_[i] < 0 || (update && !(*update)[i])) continue;
            const ParamInfo& p = params[i];
            T* w = plan.view(p.param_slot).ptr<T>();
            const T* g = plan.view(p.grad_slot).ptr<T>();
            T* mom = plan.view(momentum_[i]).ptr<T>();
            const int64_t n = p.numel(), cols = p.shape[1];
            const double beta = r.muon_momentum;
            // Decoupled weight decay, then momentum (M <- beta M + (1-beta) G).
            const double decay = p.weight_decay ? 1.0 - lr * r.weight_decay : 1.0;
            for (int64_t k = 0; k < n; ++k) {
                w[k] = static_cast<T>(w[k] * decay);
                mom[k] = static_cast<T>(beta * mom[k] + (1.0 - beta) * double(g[k]) * grad_scale);
            }
            for (const MuonSlice& s : splits_[i].slices) {
                const int64_t rows = s.num_rows();
                slice.resize(static_cast<size_t>(rows * cols));
                int64_t at = 0;
                for (auto [b, e] : s.rows)
                    for (int64_t row = b; row < e; ++row, ++at)
                        for (int64_t j = 0; j < cols; ++j) {
                            const int64_t k = row * cols + j;
                            // Nesterov: U = (1-beta) G + beta M; otherwise U = M.
                            slice[at * cols + j] = static_cast<T>(
                                r.muon_nesterov
                                    ? (1.0 - beta) * double(g[k]) * grad_scale + beta * mom[k]
                                    : double(mom[k]));
                        }
                if (uses_gram_ns(r.muon_ns_method, std::min(rows, cols), std::max(rows, cols),
                                 r.muon_num_ns_steps))
                    newton_schulz_gram(slice.data(), rows, cols, r.muon_num_ns_steps,
                                       r.muon_coefficient_type, gram_ns_restarts(), ws);
                else
                    newton_schulz(slice.data(), rows, cols, r.muon_num_ns_steps,
                                  r.muon_coefficient_type, ws);
                const double step =
                    lr * muon_scale(rows, cols, r.muon_scale_mode) * r.muon_extra_scale_factor;
                at = 0;
                for (auto [b, e] : s.rows)
                    for (int64_t row = b; row < e; ++row, ++at)
                        for (int64_t j = 0; j < cols; ++j)
                            w[row * cols + j] =
                                static_cast<T>(w[row * cols + j] - step * slice[at * cols + j]);
            }
        }
    };
    if (store_.dtype() == DType::F32)
        run(float{});
    else
        run(double{});
}

}  // namespace sparsetron
