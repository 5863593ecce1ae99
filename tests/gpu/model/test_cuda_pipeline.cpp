// Pipeline parallelism on CUDA (runtime/gpu/cuda_pipeline.h) on one GPU: the stages of a
// pipeline as threads, each with its own engine (its own stream and plan), joined by a
// communicator whose transfers copy between the threads' device buffers. Two steps of the tiny
// recipe split over two stages (layer 0 with the indexer and the embedding | layer 1, an
// IndexShare layer reading the top-k that arrives with the rows, the head and MTP with the
// embedding's copy) against the whole model on one engine: losses, gradient norms and weights.
// Over NCCL between two GPUs: the same schedule, its transfers grouped send/recv
// (parallel/nccl/nccl_comm.cpp).
#include <gtest/gtest.h>

#include <barrier>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../harness.h"
#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/config/recipe.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/runtime/device_engine.h"
#include "sparsetron/runtime/trainer.h"

#if SPARSETRON_WITH_CUDA
#include "sparsetron/ops/copy/copy.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CudaPipeline, Skipped) {
    GTEST_SKIP() << "built without CUDA: GPU tests run on the GPU machine";
}
#else

namespace {

// What the threads of one communicator share: a mailbox per (source, destination) pair for
// point-to-point transfers, and the host copies an all-reduce sums.
struct ThreadJob {
    explicit ThreadJob(int w) : ranks(w), bar(w), mail(size_t(w * w)), parts(size_t(w)) {}
    struct Mail {
        const char* data = nullptr;
        int64_t bytes = 0;
        bool taken = false;
    };
    int ranks;
    std::barrier<> bar;
    std::mutex mu;
    std::condition_variable cv;
    std::vector<Mail> mail;  // [src * ranks + dst]
    std::vector<std::vector<float>> parts;
};

class ThreadComm final : public Comm {
  public:
    ThreadComm(ThreadJob& job, int rank) : job_(job), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return job_.ranks; }
    bool on_device() const override { return true; }
    // Blocking like NCCL's grouped send/recv on a stream: the message is posted, the receive
    // waits for the peer's post and copies it, the send waits until the peer took it.
    void device_sendrecv(const void* send, int64_t send_bytes, int dst, void* recv,
                         int64_t recv_bytes, int src, void* stream) override {
        const ExecContext ctx{Device::CUDA, stream, nullptr};
        cuda::synchronize(ctx);  // the message is written
        const bool out = dst >= 0 && send_bytes > 0, in = src >= 0 && recv_bytes > 0;
        std::unique_lock<std::mutex> lock(job_.mu);
        ThreadJob::Mail* posted = nullptr;
        if (out) {
            posted = &job_.mail[size_t(rank_ * job_.ranks + dst)];
            ASSERT_EQ(posted->data, nullptr) << "a second message before the first was taken";
            *posted = {static_cast<const char*>(send), send_bytes, false};
            job_.cv.notify_all();
        }
        if (in) {
            ThreadJob::Mail& m = job_.mail[size_t(src * job_.ranks + rank_)];
            job_.cv.wait(lock, [&] { return m.data != nullptr && !m.taken; });
            ASSERT_EQ(m.bytes, recv_bytes) << "stage " << rank_ << " from " << src;
            lock.unlock();
            cuda::copy_2d(ctx, recv, 0, m.data, 0, recv_bytes, 1);
            cuda::synchronize(ctx);
            lock.lock();
            m.taken = true;
            job_.cv.notify_all();
        }
        if (out) {
            job_.cv.wait(lock, [&] { return posted->taken; });
            *posted = {};
        }
    }
    void device_allreduce_sum(float* x, int64_t n, void* stream) override {
        const ExecContext ctx{Device::CUDA, stream, nullptr};
        std::vector<float>& mine = job_.parts[size_t(rank_)];
        mine.resize(size_t(n));
        cuda::download(ctx, mine.data(), x, n * int64_t(sizeof(float)));
        job_.bar.arrive_and_wait();
        std::vector<float> sum(size_t(n), 0.f);
        for (const auto& p : job_.parts)  // rank order: every rank gets the same bits
            for (int64_t i = 0; i < n; ++i) sum[size_t(i)] += p[size_t(i)];
        job_.bar.arrive_and_wait();  // nobody overwrites a part another rank still reads
        cuda::upload(ctx, x, sum.data(), n * int64_t(sizeof(float)));
        cuda::synchronize(ctx);
    }
    void allreduce_sum(float*, int64_t) override { unused(); }
    void allreduce_sum(double*, int64_t) override { unused(); }
    void broadcast(void*, int64_t, int) override { unused(); }
    std::vector<uint64_t> allgather(uint64_t) override { unused(); }
    void alltoallv(const void*, const std::vector<int64_t>&, void*,
                   const std::vector<int64_t>&) override {
        unused();
    }
    std::unique_ptr<Comm> split(int, int) override { unused(); }
    [[noreturn]] void abort(int) override { unused(); }
    std::string name() const override { return "threads"; }

  private:
    [[noreturn]] static void unused() { throw Error("ThreadComm: a host collective was called"); }
    ThreadJob& job_;
    int rank_;
};

// The tiny recipe's top-k below its micro-batch (the sparse path) and eager steps.
Recipe pipeline_recipe() {
    Recipe r = builtin_tiny_recipe();
    r.model.dsa_indexer_topk = 128;
    r.run.cuda_graph_impl = "none";
    return r;
}

struct EngineRun {
    std::vector<DeviceEngine::StepOutcome> steps;
    std::map<std::string, std::vector<float>> weights;  // by name, after the last step
    int64_t recomputed = 0;
};

// Two steps of `mbs` on an engine of `stage` (its own host plan, initialized by name from one
// seed: every layout starts from the same weights).
EngineRun run_engine(const Recipe& r, const PipelineStage& stage,
                     const std::vector<std::vector<const MicroBatch*>>& steps, const LossScales& sc,
                     Comm* pp = nullptr, Comm* embedding = nullptr) {
    auto tp = make_training_plan(r, stage);
    tp->plan.allocate_only(Device::CPU, {MemClass::Parameters, MemClass::OptimizerState});
    tp->model->params().initialize(tp->plan, 5, r.model.init_method_std, r.model.num_layers);
    auto engine =
        make_cuda_engine(r, tp->model->params(), tp->plan, *tp->optimizer, tp->max_documents,
                         tp->chunk_rows, nullptr, nullptr, nullptr, nullptr, pp, embedding);
    engine->upload_state();
    EngineRun out;
    for (size_t s = 0; s < steps.size(); ++s) {
        out.steps.push_back(engine->run_step(steps[s], sc, r.run, int64_t(s) + 1));
        out.recomputed += engine->pipeline_recomputed();
    }
    engine->download_state();
    for (const auto& p : tp->model->params().params()) {
        std::vector<float> w(size_t(p.numel()));
        std::memcpy(w.data(), tp->plan.view(p.param_slot).data, w.size() * sizeof(float));
        out.weights[p.name] = std::move(w);
    }
    return out;
}

}  // namespace

TEST(CudaPipeline, TwoStagesMatchOneGpuOverTwoSteps) {
    REQUIRE_GPU();
    const Recipe whole = pipeline_recipe();
    Recipe r = whole;
    r.run.pipeline_model_parallel_size = 2;
    r.run.world_size = 2;
    // Three micro-batches per step: stage 0 runs a warm-up forward, two steady 1F1B pairs and
    // a drained backward.
    const int64_t slots = r.run.tokens_per_microbatch(), n = 3;
    auto plan = make_training_plan(whole);
    std::vector<std::unique_ptr<MicroBatch>> own;
    std::vector<std::vector<const MicroBatch*>> steps(2);
    CounterRng rng(31, 7);
    uint64_t draw = 0;
    int64_t targets = 0;
    for (auto& step : steps)
        for (int64_t i = 0; i < n; ++i) {
            own.push_back(std::make_unique<MicroBatch>(slots, plan->max_documents));
            for (int d = 0; d < 2; ++d) {
                std::vector<int32_t> doc(size_t(slots / 2 - 9 * (draw % 4) - d));
                for (auto& t : doc) t = int32_t(rng.bits(draw++) % uint64_t(r.model.vocab_size));
                ASSERT_TRUE(own.back()->add_document(doc));
            }
            targets = std::max(targets, own.back()->num_targets());
            step.push_back(own.back().get());
        }
    LossScales sc;
    sc.backward = true;
    sc.lm = 1.0 / double(n * targets);
    sc.mtp.assign(size_t(r.model.mtp_num_layers), 0.1 / double(n * targets));
    sc.indexer = sc.aux = 1.0 / double(n);

    const EngineRun ref = run_engine(whole, {}, steps, sc);
    ThreadJob pp_job(2), embedding_job(2);
    std::vector<EngineRun> stage(2);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int s = 0; s < 2; ++s)
        threads.emplace_back([&, s] {
            try {
                ThreadComm pp(pp_job, s), embedding(embedding_job, s);
                stage[size_t(s)] =
                    run_engine(r, pipeline_stage(r.model, r.run, s), steps, sc, &pp, &embedding);
            } catch (const std::exception& e) {
                errors[size_t(s)] = e.what();
            }
        });
    for (auto& t : threads) t.join();
    ASSERT_EQ(errors[0], "") << "stage 0";
    ASSERT_EQ(errors[1], "") << "stage 1";

    // Stage 0 runs every micro-batch's forward again before its backward (another forward ran
    // in between); the last stage runs each backward right after its forward.
    EXPECT_EQ(stage[0].recomputed, 2 * n);
    EXPECT_EQ(stage[1].recomputed, 0);
    for (size_t s = 0; s < steps.size(); ++s) {
        const auto &a = stage[0].steps[s], &b = stage[1].steps[s], &w = ref.steps[s];
        ASSERT_EQ(a.losses.size(), size_t(n));
        ASSERT_EQ(b.losses.size(), size_t(n));
        // Chained steps: Adam turns last-bit differences of fp32 sums into weight differences
        // (the tolerance of CudaTraining.FullIterationGraphMatchesEagerAndRecaptures).
        const double tol = s == 0 ? 1e-5 : 1e-4;
        for (size_t i = 0; i < size_t(n); ++i) {
            EXPECT_EQ(a.losses[i].lm_targets, 0) << "the head is on the last stage";
            EXPECT_EQ(b.losses[i].lm_targets, w.losses[i].lm_targets);
            EXPECT_NEAR(b.losses[i].lm_loss_sum, w.losses[i].lm_loss_sum,
                        tol * w.losses[i].lm_loss_sum);
            ASSERT_EQ(b.losses[i].mtp_sum.size(), w.losses[i].mtp_sum.size());
            for (size_t k = 0; k < w.losses[i].mtp_sum.size(); ++k)
                EXPECT_NEAR(b.losses[i].mtp_sum[k], w.losses[i].mtp_sum[k],
                            tol * w.losses[i].mtp_sum[k]);
            // The indexer's layer 0 on stage 0, MTP's indexer on stage 1.
            EXPECT_GT(a.losses[i].indexer_loss, 0);
            EXPECT_NEAR(a.losses[i].indexer_loss + b.losses[i].indexer_loss,
                        w.losses[i].indexer_loss, 10 * tol * w.losses[i].indexer_loss);
        }
        std::cout << "[pipeline] step " << s + 1 << ": lm " << b.losses[0].lm_loss_sum << " vs "
                  << w.losses[0].lm_loss_sum << ", grad_norm " << a.stats.grad_norm << " / "
                  << b.stats.grad_norm << " vs " << w.stats.grad_norm << "\n";
        // The clipping norm is the whole model's on every stage.
        EXPECT_EQ(a.stats.grad_norm, b.stats.grad_norm);
        EXPECT_NEAR(a.stats.grad_norm, w.stats.grad_norm, 10 * tol * w.stats.grad_norm);
        EXPECT_FALSE(a.stats.skipped);
    }
    // Every stage's weights against the whole model's; the embedding's two copies alike.
    std::vector<float> got, want;
    for (const EngineRun& st : stage)
        for (const auto& [name, w] : st.weights) {
            ASSERT_TRUE(ref.weights.count(name)) << name;
            got.insert(got.end(), w.begin(), w.end());
            const auto& rw = ref.weights.at(name);
            want.insert(want.end(), rw.begin(), rw.end());
        }
    size_t ref_values = 0;
    for (const auto& [name, w] : ref.weights) ref_values += w.size();
    EXPECT_EQ(got.size(), ref_values + ref.weights.at("model.embed_tokens.weight").size())
        << "the stages hold every parameter once, the embedding twice";
    expect_close("weights after two steps, two stages vs one GPU", got, want, 1e-4);
    EXPECT_EQ(stage[0].weights.at("model.embed_tokens.weight"),
              stage[1].weights.at("model.embed_tokens.weight"));
}

#endif
