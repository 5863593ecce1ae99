// Parallel training over MPI ranks on CPU (label mpi; ctest runs it under mpirun -np 2 and 4):
// data, expert, context (fixed and dynamic) and pipeline parallelism and the distributed optimizer
// on W ranks give the one-process run's losses and gradient norms, every rank ends with identical
// weights, and ranks with different recipes all stop with a message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "parallel/ep_exchange_check.h"
#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/optim/owner_assignment.h"
#include "sparsetron/parallel/comm/mpi/mpi_comm.h"
#include "sparsetron/parallel/context/cp_shard.h"
#include "sparsetron/parallel/layout/layout.h"
#include "sparsetron/parallel/layout/process_groups.h"
#include "sparsetron/perf/rank_ranges.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

Comm* g_comm = nullptr;

// This rank's directory for `tag`: the job size is in the name, so the -np 2 and -np 4 runs of
// this binary never share (or remove) each other's directories.
std::string rank_dir(const std::string& tag) {
    return test::temp_dir(cat(tag, ".np", g_comm->size(), ".rank", g_comm->rank()));
}

Recipe small_recipe(int world, std::vector<std::string> extra = {}) {
    std::vector<std::string> sets = {
        "hidden_size=48",         "num_attention_heads=2", "q_lora_rank=32", "kv_lora_rank=24",
        "qk_head_dim=16",         "qk_pos_emb_head_dim=8", "v_head_dim=16",  "ffn_hidden_size=96",
        "seq_length=64",          "global_batch_size=4",   "train_iters=3",  "lr_warmup_iters=2",
        cat("world_size=", world)};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_recipe("", sets);
}

// A run's final weights: the squared norm of the dense parameters (every rank holds them) and
// of each routed expert's weight this rank holds (all of them without expert parallelism).
struct Weights {
    double dense = 0;
    std::map<std::string, double> experts;
    double expert_total() const {
        double s = 0;
        for (const auto& [name, v] : experts) s += v;
        return s;
    }
};

Weights weights_of(const Trainer& t) {
    Weights w;
    for (const ParamInfo& p : t.params().params()) {
        const float* x = t.plan().view(p.param_slot).ptr<float>();
        double s = 0;
        for (int64_t i = 0; i < p.numel(); ++i) s += double(x[i]) * x[i];
        if (p.routed_expert)
            w.experts[p.name] = s;
        else
            w.dense += s;
    }
    return w;
}

std::vector<StepMetrics> run(const Recipe& r, Comm* comm, const std::string& tag,
                             Weights* weights = nullptr) {
    // Every process needs its own directory, also for the one-process reference run.
    Trainer t(r, {rank_dir(tag), "", Device::CPU, false, comm});
    std::vector<StepMetrics> out;
    t.run([&](const StepMetrics& m) { out.push_back(m); });
    if (weights) *weights = weights_of(t);
    return out;
}

uint64_t bits_of(double x) {
    uint64_t b = 0;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

// Dense weights bit-identical on every rank; the experts' on the ranks that hold the same
// experts (equal EP rank: rank % ep).
void expect_replicas_identical(const Weights& w, int ep, const std::string& what) {
    const auto dense = g_comm->allgather(bits_of(w.dense));
    const auto experts = g_comm->allgather(bits_of(w.expert_total()));
    for (size_t r = 0; r < dense.size(); ++r) {
        EXPECT_EQ(dense[r], dense[0]) << what << ": dense weights of rank " << r;
        EXPECT_EQ(experts[r], experts[r % size_t(ep)]) << what << ": experts of rank " << r;
    }
}

// Forwards to another communicator and counts the bytes alltoallv sends to other ranks (its
// splits count into the same total): shows that an expert-parallel run really exchanged rows.
class CountingComm final : public Comm {
  public:
    CountingComm(Comm& inner, std::shared_ptr<int64_t> sent) : in_(inner), sent_(std::move(sent)) {}
    CountingComm(std::unique_ptr<Comm> owned, std::shared_ptr<int64_t> sent)
        : own_(std::move(owned)), in_(*own_), sent_(std::move(sent)) {}
    int rank() const override { return in_.rank(); }
    int size() const override { return in_.size(); }
    void allreduce_sum(float* x, int64_t n) override { in_.allreduce_sum(x, n); }
    void allreduce_sum(double* x, int64_t n) override { in_.allreduce_sum(x, n); }
    void broadcast(void* d, int64_t b, int root) override { in_.broadcast(d, b, root); }
    std::vector<uint64_t> allgather(uint64_t v) override { return in_.allgather(v); }
    void alltoallv(const void* send, const std::vector<int64_t>& sb, void* recv,
                   const std::vector<int64_t>& rb) override {
        for (int r = 0; r < size(); ++r)
            if (r != rank()) *sent_ += sb[size_t(r)];
        in_.alltoallv(send, sb, recv, rb);
    }
    std::unique_ptr<Comm> split(int color, int key) override {
        return std::make_unique<CountingComm>(in_.split(color, key), sent_);
    }
    [[noreturn]] void abort(int code) override {
        in_.abort(code);
        std::abort();  // not reached: Comm::abort does not return
    }
    std::string name() const override { return "counting " + in_.name(); }

  private:
    std::unique_ptr<Comm> own_;
    Comm& in_;
    std::shared_ptr<int64_t> sent_;
};

}  // namespace

// The tracker's cross-rank columns: each rank's figures gathered into their range over the job
// (rank r reports r + 1 ms and 10 x (W - r) MiB: the ranges are [1, W] and [10, 10 W] on every
// rank).
TEST(Mpi, BenchFiguresRangeOverEveryRank) {
    const int W = g_comm->size(), r = g_comm->rank();
    const std::vector<RankRange> got =
        ranges_across_ranks(g_comm, {double(r + 1), 10.0 * double(W - r), 0.5});
    ASSERT_EQ(got.size(), 3u);
    EXPECT_EQ(got[0].min, 1.0);
    EXPECT_EQ(got[0].max, double(W));
    EXPECT_EQ(got[1].min, 10.0);
    EXPECT_EQ(got[1].max, 10.0 * W);
    EXPECT_EQ(got[2].min, 0.5);
    EXPECT_EQ(got[2].max, 0.5);
}

TEST(Mpi, DataParallelMatchesOneProcess) {
    const int W = g_comm->size();
    Weights w_dp;
    auto dp = run(small_recipe(W), g_comm, "dp", &w_dp);
    auto one = run(small_recipe(1), nullptr, "one");
    ASSERT_EQ(dp.size(), one.size());
    for (size_t i = 0; i < dp.size(); ++i) {
        // Same micro-batches, gradients summed in another order: fp32 rounding only.
        EXPECT_NEAR(dp[i].lm_loss, one[i].lm_loss, 1e-5 * one[i].lm_loss) << "step " << i + 1;
        EXPECT_NEAR(dp[i].mtp_loss, one[i].mtp_loss, 1e-5 * one[i].mtp_loss + 1e-9);
        EXPECT_NEAR(dp[i].indexer_loss, one[i].indexer_loss, 1e-4 * one[i].indexer_loss + 1e-12);
        EXPECT_NEAR(dp[i].grad_norm, one[i].grad_norm, 1e-4 * one[i].grad_norm);
        EXPECT_EQ(dp[i].targets, one[i].targets);
        EXPECT_EQ(dp[i].moe_load, one[i].moe_load) << "routing statistics summed over ranks";
    }
    // Every rank holds bit-identical weights after the steps.
    expect_replicas_identical(w_dp, 1, "DP");
}

// Expert parallelism in the model: the MoE layers (layer 1 and the MTP layer) send their routed
// rows to the experts' ranks and back. EP = W (every rank one expert block, W = 4: one expert per
// rank) and, with 4 ranks, EP 2 x EDP 2 (expert gradients summed over the 2 ranks holding the
// same experts). Losses, gradient norms and expert loads equal the one-process run's (the same
// micro-batches; an expert's gradient summed on its owner in another order: fp32 rounding only).
// A rank holds only its E / EP experts: each equals the one-process run's expert of that name
// after the steps, replicas are bit-identical.
TEST(Mpi, ExpertParallelMatchesOneProcess) {
    const int W = g_comm->size();
    Weights w1;
    auto one = run(small_recipe(1), nullptr, "ep-one", &w1);
    for (int ep = 2; ep <= W; ep *= 2) {
        Weights w;
        auto sent = std::make_shared<int64_t>(0);
        CountingComm counting(*g_comm, sent);
        auto got = run(small_recipe(W, {cat("expert_model_parallel_size=", ep)}), &counting,
                       cat("ep", ep), &w);
        // Rows went to other ranks' experts: 3 steps x micro-batches x (layer 1 + 2 MTP depths)
        // x forward and backward.
        EXPECT_GT(*sent, 0) << "EP " << ep << ": no rows were exchanged";
        ASSERT_EQ(got.size(), one.size());
        for (size_t i = 0; i < got.size(); ++i) {
            if (g_comm->rank() == 0)
                std::cout << "[ep" << ep << " x " << W / ep << "] step " << i + 1 << ": lm "
                          << got[i].lm_loss << " vs " << one[i].lm_loss << ", grad_norm "
                          << got[i].grad_norm << " vs " << one[i].grad_norm << "\n";
            EXPECT_NEAR(got[i].lm_loss, one[i].lm_loss, 1e-5 * one[i].lm_loss) << "EP " << ep;
            EXPECT_NEAR(got[i].mtp_loss, one[i].mtp_loss, 1e-5 * one[i].mtp_loss + 1e-9);
            EXPECT_NEAR(got[i].grad_norm, one[i].grad_norm, 1e-4 * one[i].grad_norm);
            EXPECT_EQ(got[i].moe_load, one[i].moe_load) << "EP " << ep << " step " << i + 1;
        }
        expect_replicas_identical(w, ep, cat("EP ", ep));
        EXPECT_NEAR(w.dense, w1.dense, 1e-6 * w1.dense) << "EP " << ep;
        ASSERT_EQ(w.experts.size() * size_t(ep), w1.experts.size())
            << "EP " << ep << ": a rank holds 1/EP of the experts";
        for (const auto& [name, v] : w.experts) {
            ASSERT_TRUE(w1.experts.count(name)) << name;
            EXPECT_NEAR(v, w1.experts.at(name), 1e-6 * w1.experts.at(name)) << name;
        }
    }
    // Force-balanced routing (the seed's benchmark setting): the receive buffers are planned at
    // tokens x top-k rows instead of W times that (ModelConfig::moe_ep_received_rows), and the
    // rule fills them exactly; a row past the plan stops the run.
    const std::vector<std::string> force = {"moe_router_force_load_balancing=true"};
    auto one_f = run(small_recipe(1, force), nullptr, "ep-one-force");
    std::vector<std::string> ep_force = force;
    ep_force.push_back(cat("expert_model_parallel_size=", W));
    auto got_f = run(small_recipe(W, ep_force), g_comm, "ep-force");
    ASSERT_EQ(got_f.size(), one_f.size());
    for (size_t i = 0; i < got_f.size(); ++i) {
        EXPECT_NEAR(got_f[i].lm_loss, one_f[i].lm_loss, 1e-5 * one_f[i].lm_loss);
        EXPECT_EQ(got_f[i].moe_load, one_f[i].moe_load);
    }
    // Distinct MTP layers, each with its own experts sharded over the ranks.
    const std::vector<std::string> distinct = {"mtp_num_layers=3", "mtp_use_repeated_layer=false",
                                               "dsa_mtp_index_kv_share=false"};
    Weights wd1, wd;
    auto one_d = run(small_recipe(1, distinct), nullptr, "ep-one-distinct", &wd1);
    std::vector<std::string> ep_distinct = distinct;
    ep_distinct.push_back(cat("expert_model_parallel_size=", W));
    auto got_d = run(small_recipe(W, ep_distinct), g_comm, "ep-distinct", &wd);
    ASSERT_EQ(got_d.size(), one_d.size());
    for (size_t i = 0; i < got_d.size(); ++i) {
        EXPECT_NEAR(got_d[i].lm_loss, one_d[i].lm_loss, 1e-5 * one_d[i].lm_loss);
        EXPECT_NEAR(got_d[i].mtp_loss, one_d[i].mtp_loss, 1e-5 * one_d[i].mtp_loss);
        EXPECT_NEAR(got_d[i].grad_norm, one_d[i].grad_norm, 1e-4 * one_d[i].grad_norm);
    }
    ASSERT_EQ(wd.experts.size() * size_t(W), wd1.experts.size());
    for (const auto& [name, v] : wd.experts)
        EXPECT_NEAR(v, wd1.experts.at(name), 1e-6 * wd1.experts.at(name)) << name;
}

// The distributed optimizer (each rank updates the parameters it owns, then broadcasts them) gives
// the one-process run's losses and final state, with AdamW and with Muon (whole matrices per rank);
// every trainable parameter has exactly one owner and the ranks share the work.
TEST(Mpi, DistributedOptimizerMatchesOneProcess) {
    const int W = g_comm->size();
    for (const std::string opt : {"adam", "muon"}) {
        const std::vector<std::string> extra = {"use_distributed_optimizer=true",
                                                "optimizer=" + opt};
        const Recipe rd = small_recipe(W, extra), r1 = small_recipe(1, {"optimizer=" + opt});
        Trainer dist(rd, {rank_dir(cat("dist.", opt)), "", Device::CPU, false, g_comm});
        Trainer one(r1, {rank_dir(cat("one.", opt)), "", Device::CPU, false, nullptr});
        std::vector<StepMetrics> md, m1;
        dist.run([&](const StepMetrics& m) { md.push_back(m); });
        one.run([&](const StepMetrics& m) { m1.push_back(m); });
        ASSERT_EQ(md.size(), m1.size());
        for (size_t i = 0; i < md.size(); ++i) {
            EXPECT_NEAR(md[i].lm_loss, m1[i].lm_loss, 1e-5 * m1[i].lm_loss) << opt << " step " << i;
            EXPECT_NEAR(md[i].grad_norm, m1[i].grad_norm, 1e-4 * m1[i].grad_norm);
        }
        // Ownership: one owner per trainable parameter, every rank owns some; AdamW's matrices
        // (the embedding, the output layer) split by rows over every rank instead.
        const std::vector<int> owners = parameter_owners(dist.params(), rd.run, W);
        const auto& params = dist.params().params();
        ASSERT_EQ(owners.size(), params.size());
        std::vector<int> per_rank(size_t(W), 0);
        int split = 0;
        for (size_t i = 0; i < params.size(); ++i) {
            const bool embedding_like =
                params[i].group == OptimGroup::AdamW && params[i].shape.size() == 2;
            EXPECT_EQ(owners[i] == kRowSplit, embedding_like) << params[i].name;
            EXPECT_EQ(owners[i] >= 0 || owners[i] == kRowSplit, params[i].trainable)
                << params[i].name;
            if (owners[i] >= 0) ++per_rank[size_t(owners[i])];
            split += owners[i] == kRowSplit;
        }
        EXPECT_GT(split, 0);
        for (int c : per_rank) EXPECT_GT(c, 0);
        // The state gathered for a checkpoint equals the one-process run's.
        dist.save();
        const MemoryPlan& pd = dist.plan();
        const MemoryPlan& p1 = one.plan();
        ASSERT_EQ(pd.class_bytes(MemClass::OptimizerState),
                  p1.class_bytes(MemClass::OptimizerState));
        const size_t n = pd.class_bytes(MemClass::OptimizerState) / 4;
        const float* sd = reinterpret_cast<const float*>(pd.class_base(MemClass::OptimizerState));
        const float* s1 = reinterpret_cast<const float*>(p1.class_base(MemClass::OptimizerState));
        double num = 0, den = 0;
        for (size_t i = 0; i < n; ++i) {
            num += double(sd[i] - s1[i]) * double(sd[i] - s1[i]);
            den += double(s1[i]) * double(s1[i]);
        }
        EXPECT_LT(std::sqrt(num / den), 1e-4) << opt << ": gathered optimizer state";
        expect_replicas_identical(weights_of(dist), 1, opt);
    }
}

namespace {

// Relative distance of two vectors: |a - b| / |b|.
double rel_diff(const float* a, const float* b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; ++i) {
        num += double(a[i] - b[i]) * double(a[i] - b[i]);
        den += double(b[i]) * double(b[i]);
    }
    return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

// Context parallelism in the model, CP = every rank: each rank computes its two chunks of every
// document of one micro-batch; one process computes all rows from the same weights. The top-k of
// every row is identical (layer 0 and MTP depth 1 run the indexer: 16 of up to 41 keys), the
// loss sums (each rank's share, summed) and the gradients (summed over the ranks) equal the
// one-process values up to fp32 summation order. Cross-entropy MTP and e2e_tv (its targets read
// rows i + k + 1, often another rank's), with the sequence aux loss on (per-document routing
// statistics over the ranks).
TEST(Mpi, ContextParallelModelMatchesOneProcess) {
    const int W = g_comm->size(), me = g_comm->rank();
    for (const std::string mtp : {"cross_entropy", "e2e_tv"}) {
        Recipe r =
            small_recipe(1, {"dsa_indexer_topk=16", "moe_aux_loss_coeff=0.01",
                             "mtp_loss_type=" + mtp, cat("mtp_detach_heads=", mtp == "e2e_tv")});
        const ModelConfig& cfg = r.model;
        const int64_t T = 64, docs = 4, chunk = 16, rows = cp_local_tokens(T, docs, W);
        MemoryPlan p1, pc;
        Glm5Model<float> one(cfg, p1, T, docs, chunk);
        Glm5Model<float> cpm(cfg, pc, rows, docs, chunk, T);
        for (auto [m, p] : {std::pair{&one, &p1}, std::pair{&cpm, &pc}}) {
            p->allocate(Device::CPU);
            m->bind();
            m->params().initialize(*p, 7, 0.05, cfg.num_layers);
        }
        cpm.set_context_parallel(g_comm);
        MicroBatch mb(T, docs);
        CounterRng rng(5, 2);
        uint64_t draw = 0;
        for (int64_t len : {41, 5, 17}) {
            std::vector<int32_t> doc(static_cast<size_t>(len));
            for (auto& t : doc) t = int32_t(rng.bits(draw++) % uint64_t(cfg.vocab_size));
            ASSERT_TRUE(mb.add_document(doc));
        }
        LossScales sc;
        sc.backward = true;
        sc.lm = 1.0 / double(mb.num_targets());
        sc.mtp = mtp == "e2e_tv" ? std::vector<double>{0.03} : std::vector<double>{0.02, 0.01};
        sc.indexer = sc.aux = 1.0;
        LossSums s1, sp;
        for (auto [m, s] : {std::pair{&one, &s1}, std::pair{&cpm, &sp}}) {
            for (size_t i = 0; i < m->params().params().size(); ++i)
                if (m->grad(int64_t(i)))
                    std::fill_n(m->grad(int64_t(i)), m->params().params()[i].numel(), 0.f);
            m->load_inputs(mb);
            *s = m->forward_backward(sc);
        }
        // Top-k: the rows this rank holds select the same keys as in the one-process run.
        const StepInputs& in = cpm.inputs();
        int64_t rows_here = 0;
        for (int64_t a : {int64_t(0), cfg.num_layers}) {
            const auto& A = cpm.application(a);
            const auto& B = one.application(a);
            for (int64_t i = 0; i < in.tokens; ++i) {
                const int64_t g = in.key_row[i];
                if (g < 0) continue;
                ++rows_here;
                ASSERT_EQ(A.topk_len[i], B.topk_len[g]) << "application " << a << " row " << g;
                for (int64_t j = 0; j < A.topk_len[i]; ++j)
                    ASSERT_EQ(A.topk[i * 16 + j], B.topk[g * 16 + j])
                        << "application " << a << " row " << g << " choice " << j;
            }
        }
        EXPECT_GT(rows_here, 0);
        EXPECT_LT(rows_here, 2 * 63) << "a CP rank computes only its chunks";
        // Loss shares summed over the ranks.
        std::vector<double> v = {sp.lm_loss_sum, double(sp.lm_targets), sp.indexer_loss,
                                 sp.aux_loss, sp.mtp_acceptance_sum};
        for (double x : sp.mtp_sum) v.push_back(x);
        g_comm->allreduce_sum(v.data(), int64_t(v.size()));
        if (me == 0)
            std::cout << "[cp" << W << " model, " << mtp << "] lm " << v[0] << " vs "
                      << s1.lm_loss_sum << ", indexer " << v[2] << " vs " << s1.indexer_loss
                      << ", aux " << v[3] << " vs " << s1.aux_loss << ", mtp " << v[5] << " vs "
                      << s1.mtp_sum[0] << "\n";
        EXPECT_NEAR(v[0], s1.lm_loss_sum, 1e-5 * s1.lm_loss_sum);
        EXPECT_EQ(int64_t(v[1]), s1.lm_targets);
        EXPECT_NEAR(v[2], s1.indexer_loss, 1e-5 * s1.indexer_loss);
        EXPECT_GT(s1.aux_loss, 0);
        EXPECT_NEAR(v[3], s1.aux_loss, 1e-5 * s1.aux_loss);
        EXPECT_NEAR(v[4], s1.mtp_acceptance_sum, 1e-5 * s1.mtp_acceptance_sum + 1e-9);
        for (size_t k = 0; k < s1.mtp_sum.size(); ++k)
            EXPECT_NEAR(v[5 + k], s1.mtp_sum[k], 1e-5 * std::fabs(s1.mtp_sum[k]) + 1e-9);
        // Gradients summed over the ranks, parameter by parameter.
        const auto& params = one.params().params();
        for (size_t i = 0; i < params.size(); ++i) {
            if (!one.grad(int64_t(i))) continue;
            const int64_t n = params[i].numel();
            g_comm->allreduce_sum(cpm.grad(int64_t(i)), n);
            double norm = 0;
            for (int64_t j = 0; j < n; ++j)
                norm += double(one.grad(int64_t(i))[j]) * one.grad(int64_t(i))[j];
            if (norm == 0) continue;  // e.g. lm_head under detached heads and no LM path
            EXPECT_LT(rel_diff(cpm.grad(int64_t(i)), one.grad(int64_t(i)), n), 2e-5)
                << mtp << ": gradient of " << params[i].name;
        }
    }
}

// Training with context parallelism against one process, the same micro-batches: CP = every
// rank, and with 4 ranks CP 2 x DP 2 and CP 2 with EP 2. Losses, gradient norms and expert loads
// equal the one-process run's (fp32 summation order only), weights bit-identical on every rank.
TEST(Mpi, ContextParallelTrainingMatchesOneProcess) {
    const int W = g_comm->size();
    const std::vector<std::string> base = {"dsa_indexer_topk=16"};
    auto one = run(small_recipe(1, base), nullptr, "cp-one");
    std::vector<std::vector<std::string>> layouts = {{cat("context_parallel_size=", W)}};
    if (W == 4) {
        layouts.push_back({"context_parallel_size=2"});
        layouts.push_back({"context_parallel_size=2", "expert_model_parallel_size=2"});
    }
    for (auto extra : layouts) {
        extra.insert(extra.end(), base.begin(), base.end());
        const std::string name = extra.size() > 2 ? cat(extra[0], "+", extra[1]) : extra[0];
        Weights w;
        auto got = run(small_recipe(W, extra), g_comm, cat("cp.", name), &w);
        ASSERT_EQ(got.size(), one.size());
        for (size_t i = 0; i < got.size(); ++i) {
            if (g_comm->rank() == 0)
                std::cout << "[" << name << "] step " << i + 1 << ": lm " << got[i].lm_loss
                          << " vs " << one[i].lm_loss << ", indexer " << got[i].indexer_loss
                          << " vs " << one[i].indexer_loss << ", grad_norm " << got[i].grad_norm
                          << " vs " << one[i].grad_norm << "\n";
            EXPECT_NEAR(got[i].lm_loss, one[i].lm_loss, 1e-5 * one[i].lm_loss) << name;
            EXPECT_NEAR(got[i].mtp_loss, one[i].mtp_loss, 1e-5 * one[i].mtp_loss + 1e-9);
            EXPECT_NEAR(got[i].indexer_loss, one[i].indexer_loss, 1e-4 * one[i].indexer_loss);
            EXPECT_NEAR(got[i].grad_norm, one[i].grad_norm, 1e-4 * one[i].grad_norm);
            EXPECT_EQ(got[i].targets, one[i].targets);
            EXPECT_EQ(got[i].moe_load, one[i].moe_load) << name << " step " << i + 1;
        }
        expect_replicas_identical(w, extra.size() > 2 ? 2 : 1, name);
    }
}

// Validation on W ranks (data parallel; with 4 ranks also CP 2 x EP 2): each rank scores its
// share of the valid micro-batches, the sums meet over every rank: the one-process run's
// validation loss (LM and MTP) over the same targets.
TEST(Mpi, ValidationMatchesOneProcess) {
    const int W = g_comm->size();
    const std::vector<std::string> base = {"split=80,20,0", "eval_interval=3", "eval_iters=2",
                                           "dsa_indexer_topk=16"};
    auto one = run(small_recipe(1, base), nullptr, "valid-one");
    ASSERT_EQ(one.size(), 3u);
    ASSERT_TRUE(one[2].valid);
    std::vector<std::vector<std::string>> layouts = {{}};
    if (W == 4) layouts.push_back({"context_parallel_size=2", "expert_model_parallel_size=2"});
    for (auto extra : layouts) {
        const std::string name = extra.empty() ? std::string("dp") : "cp2+ep2";
        extra.insert(extra.end(), base.begin(), base.end());
        auto got = run(small_recipe(W, extra), g_comm, cat("valid.", name));
        ASSERT_EQ(got.size(), 3u);
        ASSERT_TRUE(got[2].valid) << name;
        EXPECT_FALSE(got[0].valid || got[1].valid) << name;
        const auto &v = *got[2].valid, &v1 = *one[2].valid;
        if (g_comm->rank() == 0)
            std::cout << "[valid " << name << "] lm " << v.lm_loss << " vs " << v1.lm_loss
                      << ", mtp " << v.mtp_loss << " vs " << v1.mtp_loss << "\n";
        EXPECT_EQ(v.targets, v1.targets) << name;
        EXPECT_NEAR(v.lm_loss, v1.lm_loss, 1e-5 * v1.lm_loss) << name;
        EXPECT_NEAR(v.mtp_loss, v1.mtp_loss, 1e-5 * v1.mtp_loss + 1e-9) << name;
        EXPECT_GT(v1.mtp_loss, 0);
    }
}

// Dynamic CP over every rank: the step's documents (pieces of up to 64 tokens) are scheduled at 40
// tokens per rank, so longer pieces need groups of 2 ranks and shorter ones 1 (a group grows into
// an idle neighbour block: with 4 ranks some run over all 4). The documents are the one-process
// run's, regrouped: LM, MTP and indexer losses, gradient norms and expert loads match it (per-token
// loss on both sides, as dynamic CP requires: the indexer's KL over the global batch's tokens does
// not depend on the grouping), weights bit-identical on every rank.
TEST(Mpi, DynamicContextParallelTrainingMatchesOneProcess) {
    const int W = g_comm->size();
    const std::vector<std::string> base = {"dsa_indexer_topk=16", "calculate_per_token_loss=true"};
    auto one = run(small_recipe(1, base), nullptr, "dcp-one");
    std::vector<std::string> extra = {
        cat("context_parallel_size=", W), "dynamic_context_parallel=true",
        "sequence_packing_scheduler=default_dynamic_cp", "max_seqlen_per_dp_cp_rank=40"};
    extra.insert(extra.end(), base.begin(), base.end());
    Weights w;
    auto got = run(small_recipe(W, extra), g_comm, "dcp", &w);
    ASSERT_EQ(got.size(), one.size());
    std::vector<int64_t> groups;
    for (size_t i = 0; i < got.size(); ++i) {
        if (g_comm->rank() == 0) {
            std::cout << "[dynamic cp over " << W << "] step " << i + 1 << ": lm " << got[i].lm_loss
                      << " vs " << one[i].lm_loss << ", grad_norm " << got[i].grad_norm << " vs "
                      << one[i].grad_norm << ", groups by size";
            for (int64_t n : got[i].dynamic_cp_groups) std::cout << " " << n;
            std::cout << "\n";
        }
        EXPECT_NEAR(got[i].lm_loss, one[i].lm_loss, 1e-5 * one[i].lm_loss) << "step " << i + 1;
        EXPECT_NEAR(got[i].mtp_loss, one[i].mtp_loss, 1e-5 * one[i].mtp_loss + 1e-9);
        EXPECT_GT(one[i].indexer_loss, 0.0);
        EXPECT_NEAR(got[i].indexer_loss, one[i].indexer_loss, 1e-5 * one[i].indexer_loss);
        EXPECT_NEAR(got[i].grad_norm, one[i].grad_norm, 1e-4 * one[i].grad_norm);
        EXPECT_EQ(got[i].targets, one[i].targets);
        EXPECT_EQ(got[i].moe_load, one[i].moe_load) << "step " << i + 1;
        groups.resize(std::max(groups.size(), got[i].dynamic_cp_groups.size()));
        for (size_t k = 0; k < got[i].dynamic_cp_groups.size(); ++k)
            groups[k] += got[i].dynamic_cp_groups[k];
    }
    ASSERT_GE(groups.size(), 2u) << "no group of 2 ranks ran";
    EXPECT_GT(groups[1], 0) << "pieces of 64 tokens need 2 ranks at 32 per rank";
    expect_replicas_identical(w, 1, "dynamic CP");
}

// Dynamic CP with expert parallelism over every rank: a scheduled micro-batch can leave ranks
// without a group, and those ranks still take part in every MoE exchange of it (with no rows),
// so the step neither hangs nor changes: the same figures as the one-process run. At 64 tokens
// per rank every piece of these 2 x 64-token samples runs on one rank; on 4 ranks, a micro-batch
// of two pieces opens ranks 0 and 1, neither can double into the other, and ranks 2-3 stay idle
// (checked through the step's idle-rank count). On 2 ranks no schedule leaves a rank idle.
TEST(Mpi, DynamicContextParallelWithExpertParallelismMatchesOneProcess) {
    const int W = g_comm->size();
    // Every rank holds at least one expert (8 and 16 ranks: as many experts as ranks).
    const std::vector<std::string> base = {"dsa_indexer_topk=16", "calculate_per_token_loss=true",
                                           "global_batch_size=2",
                                           cat("num_experts=", std::max(4, W))};
    Weights w_one;
    auto one = run(small_recipe(1, base), nullptr, "dcp-ep-one", &w_one);
    std::vector<std::string> extra = {
        cat("context_parallel_size=", W), "dynamic_context_parallel=true",
        "sequence_packing_scheduler=default_dynamic_cp", "max_seqlen_per_dp_cp_rank=64",
        cat("expert_model_parallel_size=", W)};
    extra.insert(extra.end(), base.begin(), base.end());
    Weights w;
    auto got = run(small_recipe(W, extra), g_comm, "dcp-ep", &w);
    ASSERT_EQ(got.size(), one.size());
    int64_t idle = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (g_comm->rank() == 0)
            std::cout << "[dynamic cp x ep over " << W << "] step " << i + 1 << ": lm "
                      << got[i].lm_loss << " vs " << one[i].lm_loss << ", grad_norm "
                      << got[i].grad_norm << " vs " << one[i].grad_norm << ", idle ranks "
                      << got[i].dynamic_cp_idle_ranks << "\n";
        EXPECT_NEAR(got[i].lm_loss, one[i].lm_loss, 1e-5 * one[i].lm_loss) << "step " << i + 1;
        EXPECT_NEAR(got[i].mtp_loss, one[i].mtp_loss, 1e-5 * one[i].mtp_loss + 1e-9);
        EXPECT_NEAR(got[i].indexer_loss, one[i].indexer_loss, 1e-5 * one[i].indexer_loss);
        EXPECT_NEAR(got[i].grad_norm, one[i].grad_norm, 1e-4 * one[i].grad_norm);
        EXPECT_EQ(got[i].targets, one[i].targets);
        EXPECT_EQ(got[i].moe_load, one[i].moe_load) << "step " << i + 1;
        idle += got[i].dynamic_cp_idle_ranks;
    }
    if (W >= 4) {
        EXPECT_GT(idle, 0)
            << "no scheduled micro-batch left a rank idle: the case is not exercised";
    }
    expect_replicas_identical(w, W, "dynamic CP x EP");
    // The weights after the steps are the one-process run's: the dense ones on every rank, the
    // routed experts summed over the ranks that hold them.
    double experts = w.expert_total();
    g_comm->allreduce_sum(&experts, 1);
    EXPECT_NEAR(w.dense, w_one.dense, 1e-5 * w_one.dense);
    EXPECT_NEAR(experts, w_one.expert_total(), 1e-5 * w_one.expert_total());
}

namespace {

// A seed recipe at tiny width (recipes/overlays/cpu-tiny-width.yaml) on this job's ranks against
// a reference run of the same documents (one process, or another layout), which ctest runs first
// into test-tmp/<reference>/metrics.jsonl. The indexer loss coefficient is 0 in both: the loss is a
// mean per micro-batch, so with it the indexer's gradient depends on the grouping. Step 1 routes
// (nearly) every token alike and is equal to within `first_tol`; later steps are equal to fp32
// summation noise (`later_tol`), which flips the odd near-tie among the experts. `moved`: the
// most routed assignments a layer may move in step 1 and in later steps (one flip moves 2).
void expect_seed_recipe_matches_reference(const std::string& recipe, const std::string& reference,
                                          const std::vector<std::string>& sets, double first_tol,
                                          double later_tol, std::pair<int64_t, int64_t> moved) {
    const std::string dir = std::string(SPARSETRON_SOURCE_DIR) + "/recipes/";
    const Recipe r = load_recipe(dir + recipe + "," + dir + "overlays/cpu-tiny-width.yaml", sets);
    const std::string path = std::string(SPARSETRON_TEST_TMP) + "/" + reference + "/metrics.jsonl";
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << path << " is missing: ctest runs the reference run first";
    std::vector<nlohmann::json> one;
    for (std::string line; std::getline(in, line);) one.push_back(nlohmann::json::parse(line));
    auto got = run(r, g_comm, reference + "-ranks");
    ASSERT_EQ(got.size(), one.size());
    for (size_t i = 0; i < got.size(); ++i) {
        const double lm = one[i]["lm_loss"], mtp = one[i]["mtp_loss"], gn = one[i]["grad_norm"],
                     idx = one[i]["indexer_loss"];
        const auto loads = one[i]["moe_load"].get<std::vector<std::vector<int64_t>>>();
        if (g_comm->rank() == 0)
            std::cout << "[" << recipe << ", tiny width, " << g_comm->size() << " ranks] step "
                      << i + 1 << ": lm " << got[i].lm_loss << " vs " << lm << ", mtp "
                      << got[i].mtp_loss << " vs " << mtp << ", grad_norm " << got[i].grad_norm
                      << " vs " << gn << ", indexer " << got[i].indexer_loss << " vs " << idx
                      << ", idle ranks " << got[i].dynamic_cp_idle_ranks << "\n";
        const double tol = i == 0 ? first_tol : later_tol;
        EXPECT_NEAR(got[i].lm_loss, lm, tol * lm) << "step " << i + 1;
        EXPECT_NEAR(got[i].mtp_loss, mtp, 10 * tol * mtp) << "step " << i + 1;
        EXPECT_NEAR(got[i].grad_norm, gn, 10 * tol * gn) << "step " << i + 1;
        // The KL of two close distributions: a sum of small terms of both signs, whose relative
        // rounding after a step's update is larger than the LM loss's.
        EXPECT_GT(idx, 0.0) << "the recipe's indexer loss is on";
        const double idx_tol = std::max(10 * tol, i == 0 ? 0.0 : 1e-4);
        EXPECT_NEAR(got[i].indexer_loss, idx, idx_tol * idx) << "step " << i + 1;
        EXPECT_EQ(got[i].targets, one[i]["targets"].get<int64_t>());
        ASSERT_EQ(got[i].moe_load.size(), loads.size());
        int64_t moved_all = 0, routed_all = 0;
        for (size_t l = 0; l < loads.size(); ++l) {
            int64_t moved_here = 0, total = 0, want = 0;
            for (size_t e = 0; e < loads[l].size(); ++e) {
                moved_here += std::abs(got[i].moe_load[l][e] - loads[l][e]);
                total += got[i].moe_load[l][e];
                want += loads[l][e];
            }
            EXPECT_EQ(total, want) << "layer " << l << " step " << i + 1;
            EXPECT_LE(moved_here, i == 0 ? moved.first : moved.second)
                << "layer " << l << " step " << i + 1;
            moved_all += moved_here, routed_all += want;
        }
        if (g_comm->rank() == 0)
            std::cout << "    routed assignments moved: " << moved_all / 2 << " of " << routed_all
                      << " over " << loads.size() << " MoE layers\n";
    }
}

}  // namespace

// The seed's 16-GPU recipe as written (EP16 x dynamic CP16 over 21 layers of 64 experts, MTP x7
// e2e TV, Muon, the indexer loss at its coefficient with per-token loss) on 16 ranks (ctest
// mpi_seed_16gpu_np16).
TEST(Mpi, Seed16GpuRecipeAtTinyWidthMatchesOneProcess) {
    if (g_comm->size() != 16)
        GTEST_SKIP() << "the seed's 16-GPU layout needs 16 ranks (ctest mpi_seed_16gpu_np16)";
    expect_seed_recipe_matches_reference("glm5.2-16gpu.yaml", "seed16-one", {}, 1e-9, 1e-6,
                                         {0, 32});
}

// The seed's 256-GPU recipe's layout (PP4 with 18/20/20/20 layers x EP x dynamic CP, 78 layers
// of 256 experts, MTP x7 e2e TV, Muon) cut to 16 ranks: 4 stages of 4 ranks (EP 4, dynamic CP up
// to 4 at 128 tokens per rank) (ctest mpi_seed_256gpu_np16). Against the same layout without
// stages on 4 ranks (test-tmp/seed256-stage): each stage's ranks compute for its layers what
// those 4 ranks compute, so the runs agree to fp32 rounding (the gradient norm's sum over stages
// enters through the clipping factor). At the recipe's offset 3 every stage starts on a full
// layer. Rounding apart (hosts whose
// BLAS kernels round otherwise) flips the odd near-tie among 256 experts at width 48 (a few rows
// of a layer in step 1, from the middle stages on), and Muon carries that into the later steps:
// step 1 is compared at 1e-7 with up to 8 of a layer's routed rows moved, later steps at 3e-4
// with 1% of a layer's rows moved.
TEST(Mpi, Seed256GpuRecipeLayoutOn16RanksMatchesTheUnpipelinedLayout) {
    if (g_comm->size() != 16)
        GTEST_SKIP() << "the cut 256-GPU layout needs 16 ranks (ctest mpi_seed_256gpu_np16)";
    expect_seed_recipe_matches_reference(
        "glm5.2-256gpu.yaml", "seed256-stage",
        {"world_size=16", "expert_model_parallel_size=4", "context_parallel_size=4",
         "max_seqlen_per_dp_cp_rank=128"},
        1e-7, 3e-4, {8, 328});
}

namespace {

// Every parameter this rank holds by name: its squared norm (a pipeline stage holds its layers').
std::map<std::string, double> param_norms(const Trainer& t) {
    std::map<std::string, double> out;
    for (const ParamInfo& p : t.params().params()) {
        const float* x = t.plan().view(p.param_slot).ptr<float>();
        double s = 0;
        for (int64_t i = 0; i < p.numel(); ++i) s += double(x[i]) * x[i];
        out[p.name] = s;
    }
    return out;
}

// Four layers (dense, then MoE), full DSA layers 0, 1 and 3 with the IndexShare layer 2 over
// layer 1's top-k (offset 2), and a full MTP layer: the splits 1 + 3 and 3 + 1 start every stage
// on a full layer (Megatron's rule), the first with a shared layer inside its second stage. Four
// stages of one layer each need every layer full (dsa_indexer_topk_freq=1).
std::vector<std::string> pipeline_model(std::vector<std::string> extra = {}) {
    std::vector<std::string> out = {"num_layers=4", "moe_layer_freq=[0,1,1,1]",
                                    "dsa_indexer_topk=16", "dsa_indexer_skip_topk_offset=2"};
    out.insert(out.end(), extra.begin(), extra.end());
    return out;
}

// Runs `layout` on every rank and the one-process run of the same recipe; compares losses per
// step, the routing statistics and each parameter after the steps by name.
void expect_pipeline_matches_one_process(const std::vector<std::string>& model,
                                         const std::vector<std::string>& layout,
                                         const std::string& tag) {
    const int W = g_comm->size();
    Trainer one(small_recipe(1, model), {rank_dir(tag + "-one"), "", Device::CPU, false, nullptr});
    std::vector<StepMetrics> want;
    one.run([&](const StepMetrics& m) { want.push_back(m); });
    std::vector<std::string> sets = model;
    sets.insert(sets.end(), layout.begin(), layout.end());
    Trainer pp(small_recipe(W, sets), {rank_dir(tag), "", Device::CPU, false, g_comm});
    std::vector<StepMetrics> got;
    pp.run([&](const StepMetrics& m) { got.push_back(m); });
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
        if (g_comm->rank() == 0)
            std::cout << "[" << tag << "] step " << i + 1 << ": lm " << got[i].lm_loss << " vs "
                      << want[i].lm_loss << ", mtp " << got[i].mtp_loss << " vs "
                      << want[i].mtp_loss << ", indexer " << got[i].indexer_loss << " vs "
                      << want[i].indexer_loss << ", grad_norm " << got[i].grad_norm << " vs "
                      << want[i].grad_norm << "\n";
        EXPECT_NEAR(got[i].lm_loss, want[i].lm_loss, 1e-5 * want[i].lm_loss) << tag;
        EXPECT_NEAR(got[i].mtp_loss, want[i].mtp_loss, 1e-5 * want[i].mtp_loss + 1e-9) << tag;
        EXPECT_NEAR(got[i].indexer_loss, want[i].indexer_loss, 1e-4 * want[i].indexer_loss + 1e-12)
            << tag;
        EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, 1e-4 * want[i].grad_norm) << tag;
        EXPECT_NEAR(got[i].grad_norm_mtp, want[i].grad_norm_mtp, 1e-4 * want[i].grad_norm_mtp)
            << tag;
        EXPECT_EQ(got[i].targets, want[i].targets) << tag;
        EXPECT_EQ(got[i].moe_load, want[i].moe_load) << tag << " step " << i + 1;
        EXPECT_EQ(got[i].moe_dropped, want[i].moe_dropped) << tag;
    }
    // This rank's parameters (its stage's, its experts) equal the one-process run's.
    const auto mine = param_norms(pp), all = param_norms(one);
    EXPECT_LT(mine.size(), all.size()) << tag << ": a stage holds part of the model";
    for (const auto& [name, v] : mine) {
        ASSERT_TRUE(all.count(name)) << name;
        EXPECT_NEAR(v, all.at(name), 1e-5 * all.at(name) + 1e-12) << tag << ": " << name;
    }
}

}  // namespace

// Pipeline parallelism (1F1B) gives the one-process run: PP 2 (layers 1 + 3, the IndexShare
// layer 2 reading layer 1's top-k on the same stage) and, with 4 ranks, PP 4 (one layer each),
// PP 2 x DP 2, PP 2 x CP 2, and PP 4 with fewer micro-batches than stages; the MTP layer (kv
// sharing, its embedding a copy on the last stage whose gradient joins the first stage's) and
// the indexer loss included. With 8 ranks: PP 2 x EP 2 x DP 2 (each stage's experts sharded
// over its EP group); the seed's e2e TV with detached heads and Muon on 2 ranks; a split from
// Megatron's layout string (3 + 1 layers) on 2 ranks.
TEST(Mpi, PipelineParallelMatchesOneProcess) {
    const int W = g_comm->size();
    if (W == 2) {
        expect_pipeline_matches_one_process(
            pipeline_model(),
            {"pipeline_model_parallel_size=2", "decoder_first_pipeline_num_layers=1"}, "pp2");
        expect_pipeline_matches_one_process(
            pipeline_model({"mtp_loss_type=e2e_tv", "mtp_detach_heads=true", "optimizer=muon",
                            "mtp_num_layers=3"}),
            {"pipeline_model_parallel_size=2", "decoder_first_pipeline_num_layers=3"},
            "pp2-tv-muon");
        // Megatron's layout string: three layers on the first stage, one beside the MTP layers.
        expect_pipeline_matches_one_process(
            pipeline_model({"mtp_num_layers=2"}),
            {"pipeline_model_parallel_size=2", "pipeline_model_parallel_layout=E(t)*3|t,m*2,L"},
            "pp2-layout");
        // Interleaved virtual stages: two chunks of one layer per rank (rank 0 layers 0 and 2,
        // rank 1 layers 1 and 3 with the head and MTP), four micro-batches through Megatron's
        // interleaved 1F1B; then as a layout string, with the TV loss and Muon.
        expect_pipeline_matches_one_process(
            pipeline_model({"dsa_indexer_topk_freq=1"}),
            {"pipeline_model_parallel_size=2", "num_virtual_stages_per_pipeline_rank=2"},
            "pp2-vpp2");
        expect_pipeline_matches_one_process(
            pipeline_model({"dsa_indexer_topk_freq=1", "mtp_loss_type=e2e_tv",
                            "mtp_detach_heads=true", "optimizer=muon", "mtp_num_layers=3"}),
            {"pipeline_model_parallel_size=2", "pipeline_model_parallel_layout=Et|t|t|t,m*3,L"},
            "pp2-vpp2-layout-tv-muon");
    }
    if (W == 4) {
        expect_pipeline_matches_one_process(pipeline_model({"dsa_indexer_topk_freq=1"}),
                                            {"pipeline_model_parallel_size=4"}, "pp4");
        expect_pipeline_matches_one_process(
            pipeline_model({"dsa_indexer_topk_freq=1", "global_batch_size=2"}),
            {"pipeline_model_parallel_size=4"}, "pp4-two-micro-batches");
        expect_pipeline_matches_one_process(
            pipeline_model({"use_distributed_optimizer=true"}),
            {"pipeline_model_parallel_size=2", "decoder_last_pipeline_num_layers=3"}, "pp2xdp2");
        expect_pipeline_matches_one_process(
            pipeline_model(),
            {"pipeline_model_parallel_size=2", "context_parallel_size=2",
             "decoder_first_pipeline_num_layers=1"},
            "pp2xcp2");
        // Two chunks per rank under the distributed optimizer: two micro-batches per data-
        // parallel rank, as many as the pipeline's ranks (Megatron's all-warm-up case).
        expect_pipeline_matches_one_process(
            pipeline_model({"dsa_indexer_topk_freq=1", "use_distributed_optimizer=true"}),
            {"pipeline_model_parallel_size=2", "num_virtual_stages_per_pipeline_rank=2"},
            "pp2-vpp2xdp2");
        // Two chunks per rank under dynamic CP over each stage's two ranks (pieces of up to 64
        // tokens at 40 per rank: groups of one and of two ranks): each rank's step padded with
        // empty micro-batches to a multiple of the pipeline's 2 ranks, per-token loss on both
        // sides.
        expect_pipeline_matches_one_process(
            pipeline_model({"dsa_indexer_topk_freq=1", "calculate_per_token_loss=true"}),
            {"pipeline_model_parallel_size=2", "num_virtual_stages_per_pipeline_rank=2",
             "context_parallel_size=2", "dynamic_context_parallel=true",
             "sequence_packing_scheduler=default_dynamic_cp", "max_seqlen_per_dp_cp_rank=40"},
            "pp2-vpp2xdcp2");
    }
    if (W == 8)
        expect_pipeline_matches_one_process(
            pipeline_model(),
            {"pipeline_model_parallel_size=2", "expert_model_parallel_size=2",
             "decoder_first_pipeline_num_layers=1"},
            "pp2xep2xdp2");
    if (W == 8)
        expect_pipeline_matches_one_process(
            pipeline_model({"dsa_indexer_topk_freq=1", "global_batch_size=8"}),
            {"pipeline_model_parallel_size=2", "expert_model_parallel_size=2",
             "num_virtual_stages_per_pipeline_rank=2"},
            "pp2-vpp2xep2xdp2");
}

// Three steps of `layout` on every rank saving at step 2 into a fresh directory every rank sees
// (named after `tag`; `base` and `layout` add their save keys to it), then resumed from step 2
// on the same layout and on one process (`base`): both reproduce step 3. `check` (optional)
// looks at the checkpoint directory first.
void expect_resumes_on_any_layout(const std::string& tag, std::vector<std::string> base,
                                  const std::vector<std::string>& layout, const std::string& what,
                                  const std::function<void(const std::string&)>& check = {}) {
    const int W = g_comm->size();
    const std::string shared = cat(SPARSETRON_TEST_TMP, "/Mpi.", tag, ".np", W);
    if (g_comm->rank() == 0) {
        std::filesystem::remove_all(shared);
        std::filesystem::create_directories(shared);
    }
    g_comm->allgather(0);  // every rank waits for the directory
    base.push_back("save_interval=2");
    base.push_back("save=" + shared);
    std::vector<std::string> sets = base;
    sets.insert(sets.end(), layout.begin(), layout.end());
    std::vector<StepMetrics> full;
    {
        Trainer t(small_recipe(W, sets), {rank_dir(tag + "-save"), "", Device::CPU, true, g_comm});
        t.run([&](const StepMetrics& m) { full.push_back(m); });
    }
    ASSERT_EQ(full.size(), 3u);
    g_comm->allgather(0);  // the checkpoints are written
    const std::string ckpt = shared + "/iter_0000002";
    if (check) check(ckpt);
    Trainer resumed(small_recipe(W, sets),
                    {rank_dir(tag + "-resume"), ckpt, Device::CPU, false, g_comm});
    ASSERT_EQ(resumed.iteration(), 2);
    const StepMetrics m = resumed.train_step();
    Trainer one(small_recipe(1, base),
                {rank_dir(tag + "-resume-one"), ckpt, Device::CPU, false, nullptr});
    const StepMetrics m1 = one.train_step();
    if (g_comm->rank() == 0)
        std::cout << "[" << tag << "] step 3: lm " << m.lm_loss << " (resumed, " << what << ") / "
                  << m1.lm_loss << " (resumed, one process) vs " << full[2].lm_loss << "\n";
    EXPECT_NEAR(m.lm_loss, full[2].lm_loss, 1e-6 * full[2].lm_loss);
    EXPECT_NEAR(m.grad_norm, full[2].grad_norm, 1e-5 * full[2].grad_norm);
    EXPECT_NEAR(m1.lm_loss, full[2].lm_loss, 1e-5 * full[2].lm_loss);
    EXPECT_NEAR(m1.grad_norm, full[2].grad_norm, 1e-4 * full[2].grad_norm);
}

// A pipeline run's checkpoint holds the whole model once (a shard per stage, the last stage's
// embedding copy not written) and loads on any layout.
TEST(Mpi, PipelineCheckpointResumesOnAnyLayout) {
    const int stages = std::min(g_comm->size(), 4);  // the model has 4 layers
    // Every stage starts on a full DSA layer: 1 + 3 layers, or one each with every layer full.
    std::vector<std::string> extra = {"optimizer=muon"};
    if (stages == 4) extra.push_back("dsa_indexer_topk_freq=1");
    std::vector<std::string> pp = {cat("pipeline_model_parallel_size=", stages)};
    if (stages == 2) pp.push_back("decoder_first_pipeline_num_layers=1");
    expect_resumes_on_any_layout(
        "PipelineCheckpoint", pipeline_model(extra), pp, cat("PP ", stages),
        [&](const std::string& ckpt) {
            for (int s = 1; s <= stages; ++s)
                EXPECT_TRUE(std::filesystem::exists(
                    cat(ckpt, "/model-0000", s, "-of-0000", stages, ".safetensors")))
                    << "stage " << s;
            EXPECT_TRUE(std::filesystem::exists(ckpt + "/model.safetensors.index.json"));
        });
}

// Interleaved stages' checkpoint: a shard per pipeline rank holding both its chunks (two ranks;
// the other counts skip it).
TEST(Mpi, InterleavedPipelineCheckpointResumesOnAnyLayout) {
    if (g_comm->size() != 2) GTEST_SKIP() << "two ranks: PP 2 x 2 chunks";
    expect_resumes_on_any_layout(
        "InterleavedCheckpoint", pipeline_model({"dsa_indexer_topk_freq=1"}),
        {"pipeline_model_parallel_size=2", "num_virtual_stages_per_pipeline_rank=2"},
        "PP 2 x 2 chunks");
}

// A CP run's checkpoint resumes (CP 2, x DP 2 with 4 ranks): rank 0 writes it (every rank holds
// the same weights and optimizer state, so the checkpoint does not depend on the layout).
TEST(Mpi, ContextParallelCheckpointResumes) {
    expect_resumes_on_any_layout("ContextParallelCheckpoint", {"dsa_indexer_topk=16"},
                                 {"context_parallel_size=2"}, "CP 2");
}

// An expert-parallel run's checkpoint (experts sharded: EP = every rank; with 4 ranks also EP 2
// x EDP 2 with the distributed Muon optimizer): the first EP group's ranks write one shard each
// and rank 0 the index. Resuming from step 2 on the same layout, and on one process (which reads
// every shard), reproduces step 3: each rank's experts and their optimizer state came back.
TEST(Mpi, ExpertParallelCheckpointResumes) {
    const int W = g_comm->size();
    std::vector<std::vector<std::string>> layouts = {{cat("expert_model_parallel_size=", W)}};
    if (W == 4)
        layouts.push_back(
            {"expert_model_parallel_size=2", "use_distributed_optimizer=true", "optimizer=muon"});
    for (const auto& layout : layouts) {
        const int ep = W == 4 && layout.size() > 1 ? 2 : W;
        const std::string shared =
            cat(SPARSETRON_TEST_TMP, "/Mpi.ExpertParallelCheckpoint.np", W, ".ep", ep);
        if (g_comm->rank() == 0) {
            std::filesystem::remove_all(shared);
            std::filesystem::create_directories(shared);
        }
        g_comm->allgather(0);  // every rank waits for the directory
        std::vector<std::string> base = {"save_interval=2", "save=" + shared};
        for (const auto& x : layout)
            if (x.rfind("expert_model", 0) != 0) base.push_back(x);
        std::vector<std::string> sharded = base;
        sharded.push_back(cat("expert_model_parallel_size=", ep));
        std::vector<StepMetrics> full;
        {
            Trainer t(small_recipe(W, sharded),
                      {rank_dir(cat("ep-save", ep)), "", Device::CPU, true, g_comm});
            t.run([&](const StepMetrics& m) { full.push_back(m); });
        }
        ASSERT_EQ(full.size(), 3u);
        const std::string ckpt = shared + "/iter_0000002";
        for (int s = 1; s <= ep; ++s)
            EXPECT_TRUE(std::filesystem::exists(
                cat(ckpt, "/model-0000", s, "-of-0000", ep, ".safetensors")))
                << "shard " << s;
        EXPECT_TRUE(std::filesystem::exists(ckpt + "/model.safetensors.index.json"));
        EXPECT_TRUE(std::filesystem::exists(ckpt + "/optimizer.safetensors.index.json"));
        EXPECT_FALSE(std::filesystem::exists(ckpt + "/model.safetensors"));
        Trainer resumed(small_recipe(W, sharded),
                        {rank_dir(cat("ep-resume", ep)), ckpt, Device::CPU, false, g_comm});
        ASSERT_EQ(resumed.iteration(), 2);
        const StepMetrics m = resumed.train_step();
        std::vector<std::string> one_process;
        for (const auto& x : base)
            if (x != "use_distributed_optimizer=true") one_process.push_back(x);
        Trainer one(small_recipe(1, one_process),
                    {rank_dir(cat("ep-resume-one", ep)), ckpt, Device::CPU, false, nullptr});
        const StepMetrics m1 = one.train_step();
        if (g_comm->rank() == 0)
            std::cout << "[ep" << ep << " checkpoint] step 3: lm " << m.lm_loss << " (resumed, EP "
                      << ep << ") / " << m1.lm_loss << " (resumed, one process) vs "
                      << full[2].lm_loss << ", grad_norm " << m.grad_norm << " / " << m1.grad_norm
                      << " vs " << full[2].grad_norm << "\n";
        EXPECT_NEAR(m.lm_loss, full[2].lm_loss, 1e-6 * full[2].lm_loss);
        EXPECT_NEAR(m.grad_norm, full[2].grad_norm, 1e-5 * full[2].grad_norm);
        EXPECT_NEAR(m1.lm_loss, full[2].lm_loss, 1e-5 * full[2].lm_loss);
        EXPECT_NEAR(m1.grad_norm, full[2].grad_norm, 1e-4 * full[2].grad_norm);
        // Step 4 after the resumed step 3 uses the restored optimizer state of every expert.
        const StepMetrics m2 = resumed.train_step(), m12 = one.train_step();
        EXPECT_NEAR(m2.lm_loss, m12.lm_loss, 1e-5 * m12.lm_loss);

        // An expert shard copied in from the next iteration's checkpoint: every rank refuses
        // the mixed checkpoint, naming the file (it used to resume on mismatched experts).
        namespace fs = std::filesystem;
        const std::string mixed = shared + "/mixed",
                          shard = cat("/model-00002-of-0000", ep, ".safetensors");
        if (g_comm->rank() == 0) {
            fs::copy(ckpt, mixed, fs::copy_options::recursive);
            fs::copy_file(shared + "/iter_0000003" + shard, mixed + shard,
                          fs::copy_options::overwrite_existing);
        }
        g_comm->allgather(0);
        const std::string refused = sparsetron::test::error_of([&] {
            Trainer t(small_recipe(W, sharded),
                      {rank_dir(cat("ep-mixed", ep)), mixed, Device::CPU, false, g_comm});
        });
        EXPECT_NE(refused.find(mixed + shard + " does not belong to this checkpoint (iteration 2"),
                  std::string::npos)
            << refused;
        EXPECT_NE(refused.find("the file says it is iteration 3"), std::string::npos) << refused;
        g_comm->allgather(0);
    }
}

// A sharded checkpoint's ranks must write into one directory: ranks saving to their own ones all
// stop with a message instead of rank 0 indexing shards that are elsewhere.
TEST(Mpi, ShardedCheckpointNeedsOneDirectory) {
    const int W = g_comm->size();
    Trainer t(small_recipe(W, {cat("expert_model_parallel_size=", W), "train_iters=1"}),
              {rank_dir("ep-own-dirs"), "", Device::CPU, true, g_comm});
    t.train_step();
    try {
        t.save();
        ADD_FAILURE() << "saving to per-rank directories did not stop";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("a sharded checkpoint goes to one directory"),
                  std::string::npos)
            << e.what();
    }
}

TEST(Mpi, DifferentRecipesStopEveryRank) {
    Recipe r = small_recipe(g_comm->size());
    if (g_comm->rank() == 1) r.run.lr = 5e-3;
    std::string msg;
    try {
        Trainer t(r, {rank_dir("mismatch"), "", Device::CPU, false, g_comm});
    } catch (const Error& e) {
        msg = e.what();
    }
    EXPECT_NE(msg.find("rank 1 loaded a different recipe than rank 0"), std::string::npos) << msg;
}

TEST(Mpi, WorldSizeMustMatchTheRanks) {
    std::string msg;
    try {
        const int w = 2 * g_comm->size();
        Trainer t(small_recipe(w, {cat("global_batch_size=", w)}),
                  {rank_dir("ws"), "", Device::CPU, false, g_comm});
    } catch (const Error& e) {
        msg = e.what();
    }
    EXPECT_NE(msg.find(cat("but ", g_comm->size(), " processes were started")), std::string::npos)
        << msg;
}

// Process groups made once by Comm::split from the layout's colors (ProcessGroups): each
// communicator has the layout's members (size, rank order) and a sum over it adds exactly those
// ranks; every dynamic-CP size is there.
TEST(Mpi, ProcessGroupsFromTheLayout) {
    const int W = g_comm->size(), me = g_comm->rank();
    RunConfig r;
    r.context_parallel_size = 2;
    r.expert_model_parallel_size = W;
    const ParallelLayout l = make_layout(r, W);
    const ProcessGroups g = ProcessGroups::create(*g_comm, l);
    struct Kind {
        const char* name;
        Comm* comm;
        std::vector<int> members;
    };
    std::vector<Kind> kinds = {{"cp", g.cp.get(), l.cp_group(me)},
                               {"dp", g.dp.get(), l.dp_group(me)},
                               {"ep", g.ep.get(), l.ep_group(me)},
                               {"edp", g.edp.get(), l.edp_group(me)}};
    ASSERT_EQ(g.dynamic_cp.size(), l.dynamic_cp_sizes(1).size());
    for (int size : l.dynamic_cp_sizes(1))
        kinds.push_back({"dynamic cp", &g.dynamic(size), l.dynamic_cp_group(me, size)});
    for (const Kind& k : kinds) {
        ASSERT_EQ(k.comm->size(), int(k.members.size())) << k.name;
        EXPECT_EQ(k.members[size_t(k.comm->rank())], me) << k.name << ": rank order";
        double x = double(1 << me), want = 0;
        for (int m : k.members) want += double(1 << m);
        k.comm->allreduce_sum(&x, 1);
        EXPECT_EQ(x, want) << k.name << " group of rank " << me;
    }
    EXPECT_THROW(g.dynamic(3), Error);
}

// Expert parallelism over all ranks: each routed row reaches its expert's rank and the combined
// result equals the local computation exactly (same products, same order of the gate sums).
TEST(Mpi, ExpertParallelDispatchAndCombine) {
    test::check_ep_exchange(*g_comm);
    // And within the EP groups of a layout (EP 2 when there are 4 ranks).
    RunConfig r;
    r.expert_model_parallel_size = g_comm->size() >= 4 ? 2 : g_comm->size();
    const ParallelLayout l = make_layout(r, g_comm->size());
    std::unique_ptr<Comm> ep = g_comm->split(l.ep_color(g_comm->rank()), g_comm->rank());
    test::check_ep_exchange(*ep);
}

namespace {

// A failed assertion on one rank ends the whole job at once: that rank's test stops while the
// others wait in the test's collectives, which would otherwise hang until ctest's timeout.
class AbortJobOnFailure : public ::testing::EmptyTestEventListener {
    void OnTestPartResult(const ::testing::TestPartResult& r) override {
        if (!r.failed()) return;
        std::fprintf(stderr, "rank %d: %s:%d: %s\nrank %d: aborting the MPI job\n", g_comm->rank(),
                     r.file_name() ? r.file_name() : "?", r.line_number(), r.summary(),
                     g_comm->rank());
        std::fflush(stderr);
        g_comm->abort(1);
    }
};

}  // namespace

int main(int argc, char** argv) {
    MpiComm comm(&argc, &argv);
    g_comm = &comm;
    ::testing::InitGoogleTest(&argc, argv);
    ::testing::UnitTest::GetInstance()->listeners().Append(new AbortJobOnFailure);
    return RUN_ALL_TESTS();
}
