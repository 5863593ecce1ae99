#include "sparsetron/optim/cuda/cuda_optimizer.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/model/cuda/fp8_linear.h"
#include "sparsetron/model/param_table.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/optim/muon_batch.h"
#include "sparsetron/ops/optim/optim.h"
#include "sparsetron/optim/lr_schedule.h"
#include "sparsetron/optim/owner_assignment.h"

namespace sparsetron::cuda {

CudaOptimizer::CudaOptimizer(const CudaParams& P, MemoryPlan& plan, const ModelConfig& m,
                             const RunConfig& r, const OptimizerShard& shard, Comm* distributed,
                             Comm* expert_parallel, Comm* pipeline)
    : P_(P),
      cfg_(m),
      shard_(shard),
      dist_(shard.sharded() ? distributed : nullptr),
      ep_(expert_parallel && expert_parallel->size() > 1 ? expert_parallel : nullptr),
      pp_(pipeline && pipeline->size() > 1 ? pipeline : nullptr) {
    const auto& params = P.store().params();
    ST_CHECK(!shard.sharded() || shard.owner.size() == params.size(),
             "distributed optimizer: ", shard.owner.size(), " owners for ", params.size(),
             " parameters");
    muon_ = r.optimizer == "muon";
    separate_mtp_ = m.mtp_num_layers > 0 && m.mtp_detach_heads;
    // The distributed optimizer: each parameter's master, state and update on its owner, which
    // then broadcasts the new weights. Experts sharded over EP are every rank's own (owner -1).
    // The dense warm-up (dsa_dense_warmup) updates the indexers' weights alone: the others
    // keep no state here and are neither updated nor broadcast.
    for (size_t i = 0; i < params.size(); ++i) {
        updated_.push_back(params[i].trainable &&
                           (!r.dsa_dense_warmup || is_indexer_param(params[i].name)));
        uses_muon_.push_back(muon_ && is_muon_param(params[i]));
        local_.push_back(ep_ && params[i].routed_expert);
        mine_.push_back(updated_[i] && shard.mine(i));
    }
    int64_t max_numel = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        const bool muon = uses_muon_[i] && mine_[i];
        const bool adam = !uses_muon_[i] && mine_[i];
        const auto& p = params[i];
        // Split by rows: the moments of this rank's rows, beside its rows of the master.
        ST_CHECK(!shard.split(i) || !uses_muon_[i], "distributed optimizer: '", p.name,
                 "' is split by rows but takes Muon, which needs whole matrices");
        std::vector<int64_t> held = p.shape;
        if (shard.split(i)) held[0] /= shard.ranks;
        // Optimizer offload: the state beside its master in pinned host memory.
        const MemClass where =
            P.master_on_host(int64_t(i)) ? MemClass::HostOffload : MemClass::OptimizerState;
        m_slots_.push_back(adam ? plan.add(where, p.name + ".exp_avg", DType::F32, held) : -1);
        v_slots_.push_back(adam ? plan.add(where, p.name + ".exp_avg_sq", DType::F32, held) : -1);
        mom_slots_.push_back(
            muon ? plan.add(where, p.name + ".momentum_buffer", DType::F32, p.shape) : -1);
        // Only this rank's matrices: Newton-Schulz runs where the momentum is.
        splits_.push_back(muon ? muon_split_for(p, m, r) : MuonSplit{});
        if (muon) max_numel = std::max(max_numel, p.numel());
    }
    // Gradient-norm partial sums, [main dense | main experts | MTP dense | MTP experts]: each
    // clipping group one range, its sharded experts' partials a sub-range summed over EP.
    part_off_.assign(params.size(), 0);
    int64_t off = 0;
    for (int g = 0; g < 2; ++g) {
        if (g == 1) parts_main_ = off;
        for (int expert = 0; expert < 2; ++expert) {
            const int64_t begin = off;
            for (size_t i = 0; i < params.size(); ++i) {
                const auto& p = params[i];
                const int group = separate_mtp_ && p.mtp ? 1 : 0;
                if (!normed(p) || group != g || local_[i] != bool(expert)) continue;
                part_off_[i] = off;
                off += cuda::sum_squares_blocks(p.numel());
            }
            if (expert) expert_parts_[g] = {begin, off - begin};
        }
    }
    parts_total_ = off;
    s_parts_ = plan.add(MemClass::Workspace, "optim.grad_norm_partials", DType::F32,
                        {std::max<int64_t>(parts_total_, 1)});
    s_norm_ = plan.add(MemClass::Workspace, "optim.grad_norms", DType::F32, {2});
    if (pp_) s_stage_sums_ = plan.add(MemClass::Workspace, "optim.stage_sums", DType::F32, {2});
    s_scale_ = plan.add(MemClass::Workspace, "optim.clip_scales", DType::F32, {2});
    s_skip_ = plan.add(MemClass::Workspace, "optim.skip", DType::I32, {2});
    if (muon_) plan_muon(plan, r, max_numel);
    s_sched_ = plan.add(MemClass::Workspace, "optim.schedule", DType::F32, {3});
}

void CudaOptimizer::bind(const MemoryPlan& plan) {
    auto F = [&](MemoryPlan::Slot s) { return s < 0 ? nullptr : plan.view(s).ptr<float>(); };
    m_.clear(), v_.clear(), mom_.clear();
    for (size_t i = 0; i < m_slots_.size(); ++i) {
        m_.push_back(F(m_slots_[i]));
        v_.push_back(F(v_slots_[i]));
        mom_.push_back(F(mom_slots_[i]));
    }
    parts_ = F(s_parts_), norm_ = F(s_norm_), scale_ = F(s_scale_);
    stage_sums_ = F(s_stage_sums_);
    sched_ = F(s_sched_);
    skip_ = plan.view(s_skip_).ptr<int32_t>();
    if (muon_) bind_muon(plan);
}

void CudaOptimizer::plan_muon(MemoryPlan& plan, const RunConfig& r, int64_t max_numel) {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& p : P_.store().params()) shapes.push_back(p.shape);
    // Up to 64 Mi elements per batch (a larger matrix alone): enough matrices per GEMM to fill
    // the GPU with small per-head slices, a bounded workspace for the large ones.
    constexpr int64_t kBatchElements = int64_t(64) << 20;
    const int64_t limit = std::max(kBatchElements, max_numel);
    // This rank's matrices (splits_ holds no other), batched by shape.
    batches_ = plan_muon_batches(splits_, shapes, limit);
    // muon_ns_method: gram runs the Gram form on the batches where it costs fewer FLOPs.
    gram_.clear();
    for (const MuonBatch& b : batches_)
        gram_.push_back(uses_gram_ns(r.muon_ns_method, b.rr(), b.cc(), r.muon_num_ns_steps));
    batch_first_.clear();
    int64_t first = 0;
    for (const MuonBatch& b : batches_) batch_first_.push_back(first), first += b.count();
    // muon_fp32_matmul_prec, PyTorch's float32 matmul precision as the seed's Muon uses it:
    // "highest" fp32, "high" TF32 tensor cores, "medium" (the default) and "low" cast X to bf16
    // and run the iterations in bf16 (fp32 accumulation), as Emerging-Optimizers' Newton-Schulz
    // does at "medium".
    ns_elem_ = r.muon_fp32_matmul_prec == "medium" || r.muon_fp32_matmul_prec == "low" ? DType::BF16
                                                                                       : DType::F32;
    ns_tf32_ = r.muon_fp32_matmul_prec == "high";
    // The Gram form accumulates Q, a product of up to three polynomials between restarts, whose
    // small eigenvalues bf16's 8-bit mantissa loses: it runs in fp16 instead (same speed; values
    // stay far below fp16's 65504: Q's eigenvalues are products of at most three Q_i of <= 4.1
    // between restarts; docs/optimizer.md).
    ns_gram_elem_ = ns_elem_ == DType::BF16 ? DType::F16 : ns_elem_;
    int64_t stack = 0, squares = 0, norms = 0, problems = 0;
    for (size_t k = 0; k < batches_.size(); ++k) {
        const MuonBatch& b = batches_[k];
        stack = std::max(stack, b.elements());
        squares =
            std::max(squares, (gram_[k] ? cuda::kGramSquares : 2) * b.count() * b.rr() * b.rr());
        norms = std::max(norms, cuda::muon_gathered_norm_floats(b.count(), b.rows, b.cols));
        problems += b.count();
    }
    // The gathered fp32 momentum stack; W [count, rr, cc], its copy Y and A, B [count, rr, rr]
    // (the Gram form: kGramSquares of them) in the iteration's element type (both forms' types
    // have the same size); norm partials; the problem table.
    // (A rank of the distributed optimizer may own no matrix: one-element areas then.)
    stack = std::max<int64_t>(stack, 1), norms = std::max<int64_t>(norms, 1);
    problems = std::max<int64_t>(problems, 1);
    s_stack_ = plan.add(MemClass::Workspace, "optim.muon_stack", DType::F32, {stack});
    s_ns_ = plan.add(MemClass::Workspace, "optim.newton_schulz", ns_elem_, {2 * stack + squares});
    ns_stack_ = stack;
    s_ns_norms_ = plan.add(MemClass::Workspace, "optim.muon_norms", DType::F32, {norms});
    static_assert(sizeof(cuda::MuonDeviceProblem) % 8 == 0);
    s_problems_ = plan.add(MemClass::Workspace, "optim.muon_problems", DType::I64,
                           {problems * int64_t(sizeof(cuda::MuonDeviceProblem) / 8)});
}

void CudaOptimizer::bind_muon(const MemoryPlan& plan) {
    stack_ = plan.view(s_stack_).ptr<float>();
    ns_ = plan.view(s_ns_).data;
    ns_norms_ = plan.view(s_ns_norms_).ptr<float>();
    problems_ = reinterpret_cast<cuda::MuonDeviceProblem*>(plan.view(s_problems_).data);
    // The table of every batch's problems, back to back (pointers are fixed once bound).
    // The apply also decays the master and rewrites the bf16 copy, so the problems of a
    // parameter must cover each of its elements exactly once (checked by row count: slices are
    // disjoint by construction).
    std::vector<cuda::MuonDeviceProblem> table;
    const auto& params = P_.store().params();
    std::vector<int64_t> covered(params.size(), 0);
    for (const MuonBatch& b : batches_)
        for (const MuonProblem& q : b.problems) {
            const CudaParam& gp = P_[q.param];
            const auto& p = params[size_t(q.param)];
            const int32_t group = separate_mtp_ && p.mtp ? 1 : 0;
            table.push_back({gp.grad, mom_[q.param], gp.master, gp.w, q.row0, q.seg_rows,
                             q.seg_stride, group, p.weight_decay ? 1 : 0, gp.grad16});
            covered[size_t(q.param)] += b.rows * b.cols;
        }
    for (size_t i = 0; i < params.size(); ++i)
        ST_CHECK(!uses_muon_[i] || !mine_[i] || covered[i] == P_[int64_t(i)].numel,
                 "Muon batches cover ", covered[i], " of ", params[i].name, "'s ",
                 P_[int64_t(i)].numel, " elements");
    copy_to_device(problems_, table.data(), table.size() * sizeof(table[0]));
}

void CudaOptimizer::stage_schedule(const ExecContext& ctx, const RunConfig& run, int64_t step) {
    const float sched[3] = {float(learning_rate(run, step)),
                            float(1.0 - std::pow(double(float(run.adam_beta1)), double(step))),
                            float(1.0 - std::pow(double(float(run.adam_beta2)), double(step)))};
    cuda::upload(ctx, sched_, sched, sizeof(sched));
}

void CudaOptimizer::enqueue_step(const ExecContext& ctx, const RunConfig& run) {
    const auto& params = P_.store().params();
    for (size_t i = 0; i < params.size(); ++i)
        if (normed(params[i])) {
            const CudaParam& gp = P_[int64_t(i)];
            if (gp.grad16)
                cuda::sum_squares_partials(ctx, gp.grad16, gp.numel, parts_ + part_off_[i]);
            else
                cuda::sum_squares_partials(ctx, gp.grad, gp.numel, parts_ + part_off_[i]);
        }
    // Sharded experts: the partials of every rank's experts (the same layout on every EP rank)
    // summed, so each clipping group's norm covers all experts.
    if (ep_)
        for (const auto& [begin, count] : expert_parts_)
            if (count > 0) ep_->device_allreduce_sum(parts_ + begin, count, ctx.stream);
    const float clip = float(run.clip_grad);
    if (pp_) {
        // Pipeline stages hold other parameters: each group's sum of squares over the stages.
        cuda::sum_partials(ctx, parts_, parts_main_, stage_sums_);
        cuda::sum_partials(ctx, parts_ + parts_main_, parts_total_ - parts_main_, stage_sums_ + 1);
        pp_->device_allreduce_sum(stage_sums_, 2, ctx.stream);
    }
    const float* main = pp_ ? stage_sums_ : parts_;
    const float* mtp = pp_ ? stage_sums_ + 1 : parts_ + parts_main_;
    const int64_t n_main = pp_ ? 1 : parts_main_, n_mtp = pp_ ? 1 : parts_total_ - parts_main_;
    cuda::clip_scale(ctx, main, n_main, clip, norm_, scale_, skip_);
    if (separate_mtp_) {
        cuda::clip_scale(ctx, mtp, n_mtp, clip, norm_ + 1, scale_ + 1, skip_ + 1);
        cuda::merge_skip(ctx, skip_, 2);
    }
    for (const int32_t* veto : vetoes_) cuda::veto_skip(ctx, skip_, separate_mtp_ ? 2 : 1, veto);
    for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        if (!p.trainable) continue;
        const int g = separate_mtp_ && p.mtp ? 1 : 0;
        const CudaParam& gp = P_[int64_t(i)];
        if (!mine_[i] || uses_muon_[i]) continue;  // Muon: the batches below
        // lr and the bias corrections come from the staged schedule (graph-safe).
        const cuda::AdamwHyper hp{.beta1 = float(run.adam_beta1),
                                  .beta2 = float(run.adam_beta2),
                                  .eps = float(run.adam_eps),
                                  .weight_decay = p.weight_decay ? float(run.weight_decay) : 0.f,
                                  .schedule = sched_};
        // The elements this rank holds: all, or its rows of a split parameter.
        bf16* w = gp.w ? gp.w + gp.first : nullptr;
        if (gp.grad16)
            cuda::adamw_update(ctx, hp, gp.master, gp.grad16 + gp.first, m_[i], v_[i], gp.held,
                               scale_ + g, skip_ + g, w);
        else
            cuda::adamw_update(ctx, hp, gp.master, gp.grad + gp.first, m_[i], v_[i], gp.held,
                               scale_ + g, skip_ + g, w);
    }
    // Distributed: the AdamW parameters from their owners on the side stream, overlapping
    // Newton-Schulz; the Muon matrices after it. A skipped step broadcasts the unchanged
    // weights (the skip decision is the same on every rank).
    if (dist_) {
        ST_ASSERT(side_, "distributed optimizer: prepare(ctx) was not called");
        side_->fork();
        broadcast_from_owners(side_->ctx(), false);
    }
    // Newton-Schulz, the decoupled decay (1 - lr wd from the staged learning rate), the
    // orthogonalized update and the bf16 copy, batch by batch; the momentum in the gather.
    if (muon_) run_muon_batches(ctx, run);
    if (dist_) {
        broadcast_from_owners(ctx, true);
        side_->join();
    }
}

void CudaOptimizer::broadcast_from_owners(const ExecContext& ctx, bool muon) {
    const auto& params = P_.store().params();
    for (size_t i = 0; i < params.size(); ++i) {
        const int owner = shard_.owner[i];
        const CudaParam& gp = P_[int64_t(i)];
        if (!updated_[i]) continue;
        if (shard_.split(i) && !muon) {
            // Every rank's rows of the bf16 copy from that rank.
            ST_ASSERT(gp.w, "distributed optimizer: ", params[i].name,
                      " is split by rows but has no bf16 copy");
            dist_->device_allgather(gp.w, gp.held * int64_t(sizeof(bf16)), ctx.stream);
            continue;
        }
        if (owner < 0 || uses_muon_[i] != muon) continue;
        if (gp.fp8) {
            send_fp8_copy(ctx, i);
        } else if (P_.master_read(int64_t(i))) {
            // A master every rank keeps: it goes, and the others refresh their bf16 copies.
            dist_->device_broadcast(gp.master, gp.numel * int64_t(sizeof(float)), owner,
                                    ctx.stream);
            if (owner != shard_.rank && gp.w) cuda::f32_to_bf16(ctx, gp.master, gp.w, gp.numel);
        } else {
            ST_ASSERT(gp.w, "distributed optimizer: ", params[i].name,
                      " has neither a master on every rank nor a bf16 copy");
            dist_->device_broadcast(gp.w, gp.numel * int64_t(sizeof(bf16)), owner, ctx.stream);
        }
    }
}

void CudaOptimizer::send_fp8_copy(const ExecContext& ctx, size_t i) {
    const CudaParam& gp = P_[int64_t(i)];
    const int owner = shard_.owner[i];
    if (owner == shard_.rank) quantize_fp8_copy(ctx, gp.master, *gp.fp8);
    dist_->device_broadcast(gp.fp8->block, gp.fp8->bytes(), owner, ctx.stream);
}

void CudaOptimizer::gather_fp8_copies(const ExecContext& ctx) {
    for (size_t i = 0; i < P_.size(); ++i)
        if (P_[int64_t(i)].fp8) send_fp8_copy(ctx, i);
}

StepStats CudaOptimizer::read_stats(const ExecContext& ctx, const RunConfig& run,
                                    int64_t step) const {
    StepStats st;
    st.lr = learning_rate(run, step);
    float norms[2] = {0, 0};
    int32_t skip = 0;
    cuda::download(ctx, norms, norm_, separate_mtp_ ? 2 * sizeof(float) : sizeof(float));
    cuda::download(ctx, &skip, skip_, sizeof(int32_t));
    st.grad_norm = norms[0];
    st.grad_norm_mtp = separate_mtp_ ? norms[1] : 0.0;
    st.skipped = skip != 0;
    return st;
}

void CudaOptimizer::run_muon_batches(const ExecContext& ctx, const RunConfig& r) {
    std::vector<std::array<float, 3>> coefficients;
    for (int64_t k = 0; k < r.muon_num_ns_steps; ++k) {
        const MuonCoefficients c = muon_ns_coefficients(r.muon_coefficient_type, k);
        coefficients.push_back({float(c.a), float(c.b), float(c.c)});
    }
    const int64_t es = int64_t(dtype_size(ns_elem_));
    char* base = static_cast<char*>(ns_);  // W [stack]
    char* y = base + ns_stack_ * es;       // [stack]
    char* a = y + ns_stack_ * es;          // [gram]
    // Batch k gathered, normalized and orthogonalized into `w`.
    auto orthogonalize = [&](int k, char* w) {
        const MuonBatch& b = batches_[size_t(k)];
        const cuda::MuonDeviceProblem* table = problems_ + batch_first_[size_t(k)];
        const DType elem = elem_of(size_t(k));
        cuda::muon_gather_batch(ctx, table, b.count(), b.rows, b.cols, b.transposed(),
                                float(r.muon_momentum), r.muon_nesterov, scale_, stack_, skip_,
                                ns_norms_);
        const bool gram = gram_[size_t(k)];
        const float x_scale = gram ? cuda::gram_ns_x_scale(b.rr(), b.cc()) : 1.f;
        cuda::muon_normalize_gathered(ctx, stack_, b.count(), b.rows, b.cols, 1e-7f, ns_norms_,
                                      elem, w, x_scale);
        if (gram) {
            cuda::newton_schulz_gram_batch(ctx, w, y, a, b.count(), b.rr(), b.cc(), coefficients,
                                           gram_ns_restarts(), elem, ns_tf32_, x_scale);
        } else {
            char* bb = a + b.count() * b.rr() * b.rr() * es;
            cuda::newton_schulz_batch(ctx, w, y, a, bb, b.count(), b.rr(), b.cc(), coefficients,
                                      elem, ns_tf32_);
        }
    };
    auto apply = [&](int k, const char* w) {
        const MuonBatch& b = batches_[size_t(k)];
        // The step is lr (staged on the device) times the shape scale.
        const float factor =
            float(muon_scale(b.rows, b.cols, r.muon_scale_mode) * r.muon_extra_scale_factor);
        cuda::muon_apply_batch(ctx, problems_ + batch_first_[size_t(k)], b.count(), b.rows, b.cols,
                               b.transposed(), w, elem_of(size_t(k)), factor, skip_, sched_,
                               float(r.weight_decay));
    };
    for (int k = 0; k < int(batches_.size()); ++k) {
        orthogonalize(k, base);
        apply(k, base);
    }
}

void CudaOptimizer::prepare(const ExecContext& ctx) {
    if (dist_ && !side_) side_ = std::make_unique<cuda::SideStream>(ctx);
}

std::vector<std::pair<std::string, MemoryPlan::Slot>> CudaOptimizer::state_tensors() const {
    std::vector<std::pair<std::string, MemoryPlan::Slot>> out;
    const auto& params = P_.store().params();
    for (size_t i = 0; i < params.size(); ++i) {
        if (m_slots_[i] >= 0) {
            out.emplace_back(params[i].name + ".exp_avg", m_slots_[i]);
            out.emplace_back(params[i].name + ".exp_avg_sq", v_slots_[i]);
        }
        if (mom_slots_[i] >= 0)
            out.emplace_back(params[i].name + ".momentum_buffer", mom_slots_[i]);
    }
    return out;
}

}  // namespace sparsetron::cuda
