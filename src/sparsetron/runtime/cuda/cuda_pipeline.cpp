#include "sparsetron/runtime/cuda/cuda_pipeline.h"

#include <algorithm>
#include <limits>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/copy/copy.h"

namespace sparsetron {
namespace {

// The pipeline rank and rank count of a model's stages (chunk c is stage c x P + rank).
std::pair<int, int> rank_of(const cuda::CudaGlm5Model& model) {
    const std::vector<PipelineStage>& st = model.stages();
    const int chunks = int(st.size()), ranks = st.front().count / chunks;
    ST_CHECK(ranks * chunks == st.front().count, "pipeline: ", chunks, " chunks of ",
             st.front().count, " stages");
    for (int c = 0; c < chunks; ++c)
        ST_CHECK(st[size_t(c)].index == c * ranks + st.front().index,
                 "pipeline: the model's chunk ", c, " is stage ", st[size_t(c)].index,
                 ", not stage ", c * ranks + st.front().index, " of ", st.front().count);
    return {st.front().index, ranks};
}

}  // namespace

PipelineBuffers plan_pipeline_buffers(const cuda::CudaGlm5Model& model, MemoryPlan& plan,
                                      int64_t max_microbatches) {
    const auto [rank, ranks] = rank_of(model);
    const int chunks = int(model.stages().size());
    PipelineBuffers b;
    b.row_bytes = model.tokens() * model.config().hidden_size * int64_t(sizeof(bf16));
    // The most messages held at once over the step sizes a step may have (interleaving takes
    // micro-batches in groups of P): past the schedule's warm-up every step holds as many, so
    // a few groups beyond it bound an unbounded count (dynamic CP); the largest count itself
    // when bounded.
    const int64_t unit = chunks > 1 ? ranks : 1;
    std::vector<int64_t> counts;
    for (int64_t k = 1; k <= chunks + 3 && k * unit <= max_microbatches; ++k)
        counts.push_back(k * unit);
    if (max_microbatches < std::numeric_limits<int64_t>::max() &&
        max_microbatches / unit * unit > 0)
        counts.push_back(max_microbatches / unit * unit);
    for (const int64_t n : counts)
        for (const bool backward : {true, false}) {
            const PipelineTimetable tt(ranks, chunks, n, backward);
            b.forward_slots = std::max(b.forward_slots, tt.held_inputs(rank));
            b.grad_slots = std::max(b.grad_slots, tt.held_gradients(rank));
        }
    if (b.forward_slots > 0)
        b.forward = plan.add(MemClass::Activations, "pipeline.forward_messages", DType::U8,
                             {b.forward_slots * b.row_bytes});
    if (b.grad_slots > 0)
        b.grad = plan.add(MemClass::Activations, "pipeline.grad_messages", DType::U8,
                          {b.grad_slots * b.row_bytes});
    return b;
}

int64_t pipeline_step_bound(const RunConfig& run) {
    return run.dynamic_context_parallel ? std::numeric_limits<int64_t>::max()
                                        : run.microbatches_per_step();
}

CudaPipeline::CudaPipeline(cuda::CudaGlm5Model& model, Comm& pp, MemoryPlan& plan,
                           int64_t max_microbatches)
    : model_(model), pp_(pp), chunks_(int(model.stages().size())) {
    std::tie(rank_, ranks_) = rank_of(model);
    ST_CHECK(rank_ == pp.rank() && ranks_ == pp.size(), "pipeline: the model holds pipeline rank ",
             rank_, " of ", ranks_, " but this rank is ", pp.rank(), " of ", pp.size());
    ST_CHECK(pp.on_device(), "CUDA pipeline parallelism needs device transfers (NCCL); the ",
             pp.name(), " communicator has none");
    buf_ = plan_pipeline_buffers(model, plan, max_microbatches);
}

void CudaPipeline::bind(const MemoryPlan& plan) {
    auto at = [&](MemoryPlan::Slot s) {
        return s < 0 ? nullptr : static_cast<char*>(plan.view(s).data);
    };
    forward_ = at(buf_.forward), grad_ = at(buf_.grad);
}

const PipelineTimetable& CudaPipeline::timetable(int64_t n, bool backward) {
    auto& tt = timetables_[{n, backward}];
    if (!tt) tt = std::make_unique<PipelineTimetable>(ranks_, chunks_, n, backward);
    return *tt;
}

char* CudaPipeline::message(bool grad, int64_t micro_batch, int chunk) const {
    const auto it = held_.find({grad, micro_batch, chunk});
    ST_ASSERT(it != held_.end(), "pipeline: a message the timetable did not deliver");
    return (grad ? grad_ : forward_) + it->second * buf_.row_bytes;
}

void CudaPipeline::release(bool grad, int64_t micro_batch, int chunk) {
    const auto it = held_.find({grad, micro_batch, chunk});
    if (it == held_.end()) return;
    (grad ? free_grad_ : free_forward_).push_back(it->second);
    held_.erase(it);
}

void CudaPipeline::load(const ExecContext& ctx, int64_t i, const int32_t* inputs) {
    if (loaded_ == i) return;
    if (feed_)
        feed_->load(i);
    else
        model_.copy_inputs_from(ctx, inputs + i * model_.input_words());
    loaded_ = i;
}

void CudaPipeline::forward(const ExecContext& ctx, const LossScales& sc,
                           const PipelineTimetable& tt, const PipelineWork& w,
                           const int32_t* inputs, double* sums, bool kept) {
    const int64_t i = w.micro_batch;
    load(ctx, i, inputs);
    if (tt.reads_message(rank_, w)) {
        cuda::copy_2d(ctx, model_.stage_input(w.chunk), 0, message(false, i, w.chunk), 0,
                      buf_.row_bytes, 1);
        if (!sc.backward) release(false, i, w.chunk);
    }
    model_.enqueue_forward(ctx, sc, /*recompute=*/false, kept, w.chunk);
    const int64_t ns = model_.n_sums();
    if (feed_)
        feed_->forwarded(i);
    else
        cuda::copy_2d(ctx, sums + (i * chunks_ + w.chunk) * ns, 0, model_.sums(), 0,
                      ns * int64_t(sizeof(double)), 1);
    resident_ = kept ? std::pair<int, int64_t>{w.chunk, i} : std::pair<int, int64_t>{-1, -1};
}

void CudaPipeline::backward(const ExecContext& ctx, const LossScales& sc,
                            const PipelineTimetable& tt, const PipelineWork& w,
                            const int32_t* inputs) {
    const int64_t i = w.micro_batch;
    if (resident_ != std::pair<int, int64_t>{w.chunk, i}) {
        load(ctx, i, inputs);
        if (tt.reads_message(rank_, PipelineWork{false, i, w.chunk}))
            cuda::copy_2d(ctx, model_.stage_input(w.chunk), 0, message(false, i, w.chunk), 0,
                          buf_.row_bytes, 1);
        model_.enqueue_forward(ctx, sc, /*recompute=*/true, /*kept=*/true, w.chunk);
        ++recomputed_;
    }
    release(false, i, w.chunk);
    if (tt.reads_message(rank_, w)) {
        cuda::copy_2d(ctx, model_.stage_grad(), 0, message(true, i, w.chunk), 0, buf_.row_bytes, 1);
        release(true, i, w.chunk);
    }
    model_.enqueue_backward(ctx, sc, w.chunk);
    resident_ = {-1, -1};
}

void CudaPipeline::shift(const ExecContext& ctx, const PipelineTimetable& tt, int64_t t,
                         const PipelineWork* w, bool forward) {
    const PipelineTimetable::RingShift s = tt.ring_shift(rank_, t, forward);
    if (!s.send && !s.recv) return;
    const void* out = nullptr;
    if (s.send)
        out = forward ? static_cast<const void*>(model_.stage_output(w->chunk))
                      : static_cast<const void*>(model_.stage_grad());
    char* in = nullptr;
    if (s.recv) {
        // A forward message feeds a forward; a gradient, the backward of the same chunk.
        const bool grad = s.feeds.backward;
        std::vector<int64_t>& free = grad ? free_grad_ : free_forward_;
        ST_CHECK(!free.empty(), "pipeline: more ", grad ? "gradients" : "forward messages",
                 " held than planned (", grad ? buf_.grad_slots : buf_.forward_slots, ") at tick ",
                 t, " of a step of these micro-batches");
        held_[{grad, s.feeds.micro_batch, s.feeds.chunk}] = free.back();
        free.pop_back();
        in = message(grad, s.feeds.micro_batch, s.feeds.chunk);
    }
    pp_.device_sendrecv(out, s.send ? buf_.row_bytes : 0, s.to, in, s.recv ? buf_.row_bytes : 0,
                        s.from, ctx.stream);
}

void CudaPipeline::enqueue(const ExecContext& ctx, const LossScales& sc, int64_t n,
                           const int32_t* inputs, double* sums,
                           const std::function<void()>& before_last_backward) {
    feed_ = nullptr;
    schedule(ctx, sc, n, inputs, sums, before_last_backward);
}

void CudaPipeline::enqueue(const ExecContext& ctx, const LossScales& sc, int64_t n,
                           const PipelineHostFeed& feed,
                           const std::function<void()>& before_last_backward) {
    struct Held {
        const PipelineHostFeed*& feed;
        ~Held() { feed = nullptr; }
    } held{feed_};
    feed_ = &feed;
    schedule(ctx, sc, n, nullptr, nullptr, before_last_backward);
}

void CudaPipeline::schedule(const ExecContext& ctx, const LossScales& sc, int64_t n,
                            const int32_t* inputs, double* sums,
                            const std::function<void()>& before_last_backward) {
    const PipelineTimetable& tt = timetable(n, sc.backward);
    resident_ = {-1, -1}, loaded_ = -1, recomputed_ = 0;
    held_.clear();
    free_forward_.clear(), free_grad_.clear();
    for (int64_t s = buf_.forward_slots; s-- > 0;) free_forward_.push_back(s);
    for (int64_t s = buf_.grad_slots; s-- > 0;) free_grad_.push_back(s);
    const std::vector<PipelineWork>& order = tt.order(rank_);
    int64_t last_backward = -1;
    for (size_t k = 0; k < order.size(); ++k)
        if (order[k].backward) last_backward = int64_t(k);
    for (int64_t t = 0; t < tt.ticks(); ++t) {
        const PipelineWork* w = tt.at(rank_, t);
        if (w) {
            const int64_t k = tt.index_at(rank_, t);
            if (!w->backward) {
                // A forward's activations serve its backward when that backward comes next
                // (the last stage); the others are run again before their backward.
                const PipelineWork* after =
                    size_t(k + 1) < order.size() ? &order[size_t(k + 1)] : nullptr;
                const bool kept = !sc.backward || (after && after->backward &&
                                                   after->micro_batch == w->micro_batch &&
                                                   after->chunk == w->chunk);
                forward(ctx, sc, tt, *w, inputs, sums, kept);
            } else {
                if (k == last_backward && before_last_backward) before_last_backward();
                backward(ctx, sc, tt, *w, inputs);
            }
        }
        shift(ctx, tt, t, w, true);
        shift(ctx, tt, t, w, false);
    }
    ST_ASSERT(held_.empty(), "pipeline: a step left messages held");
}

}  // namespace sparsetron
