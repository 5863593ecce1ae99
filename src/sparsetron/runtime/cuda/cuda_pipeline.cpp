#include "sparsetron/runtime/cuda/cuda_pipeline.h"

#include <algorithm>
#include <limits>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/copy/copy.h"

namespace sparsetron {

PipelineBuffers plan_pipeline_buffers(const cuda::CudaGlm5Model& model, MemoryPlan& plan,
                                      int64_t max_microbatches) {
    const PipelineStage& st = model.stage();
    PipelineBuffers b;
    b.row_bytes = model.tokens() * model.config().hidden_size * int64_t(sizeof(bf16));
    b.message_bytes = b.row_bytes;
    // Micro-batches in flight on stage s: its warm-up forwards and the one before the first
    // backward (their messages are kept until their backward).
    if (!st.first()) {
        b.ring_slots =
            std::max<int64_t>(1, std::min<int64_t>(st.count - st.index, max_microbatches));
        b.ring = plan.add(MemClass::Activations, "pipeline.messages_in", DType::U8,
                          {b.ring_slots * b.message_bytes});
    }
    if (!st.last()) {
        b.send =
            plan.add(MemClass::Activations, "pipeline.message_out", DType::U8, {b.message_bytes});
        b.grad = plan.add(MemClass::Activations, "pipeline.grad_in", DType::U8, {b.row_bytes});
    }
    return b;
}

int64_t pipeline_step_bound(const RunConfig& run) {
    return run.dynamic_context_parallel ? std::numeric_limits<int64_t>::max()
                                        : run.microbatches_per_step();
}

CudaPipeline::CudaPipeline(cuda::CudaGlm5Model& model, Comm& pp, MemoryPlan& plan,
                           int64_t max_microbatches)
    : model_(model),
      pp_(pp),
      stage_(pp.rank()),
      stages_(pp.size()),
      first_(model.stage().first()),
      last_(model.stage().last()) {
    ST_CHECK(model.stage().index == stage_ && model.stage().count == stages_,
             "pipeline: the model holds stage ", model.stage().index, " of ", model.stage().count,
             " but this rank is stage ", stage_, " of ", stages_);
    ST_CHECK(pp.on_device(), "CUDA pipeline parallelism needs device transfers (NCCL); the ",
             pp.name(), " communicator has none");
    buf_ = plan_pipeline_buffers(model, plan, max_microbatches);
}

void CudaPipeline::bind(const MemoryPlan& plan) {
    auto at = [&](MemoryPlan::Slot s) {
        return s < 0 ? nullptr : static_cast<char*>(plan.view(s).data);
    };
    ring_ = at(buf_.ring), send_ = at(buf_.send), grad_in_ = at(buf_.grad);
}

void CudaPipeline::load(const ExecContext& ctx, int64_t i, const int32_t* inputs) {
    if (feed_)
        feed_->load(i);
    else
        model_.copy_inputs_from(ctx, inputs + i * model_.input_words());
    if (first_) return;
    const char* m = ring(i);
    cuda::copy_2d(ctx, model_.stage_input(), 0, m, 0, buf_.row_bytes, 1);
}

void CudaPipeline::forward(const ExecContext& ctx, const LossScales& sc, int64_t i,
                           const int32_t* inputs, double* sums, bool kept) {
    load(ctx, i, inputs);
    model_.enqueue_forward(ctx, sc, /*recompute=*/false, kept);
    const int64_t ns = model_.n_sums();
    if (feed_)
        feed_->forwarded(i);
    else
        cuda::copy_2d(ctx, sums + i * ns, 0, model_.sums(), 0, ns * int64_t(sizeof(double)), 1);
    resident_ = i;
    if (last_) return;
    cuda::copy_2d(ctx, send_, 0, model_.stage_output(), 0, buf_.row_bytes, 1);
}

void CudaPipeline::backward(const ExecContext& ctx, const LossScales& sc, int64_t i,
                            const int32_t* inputs) {
    if (resident_ != i) {
        load(ctx, i, inputs);
        model_.enqueue_forward(ctx, sc, /*recompute=*/true);
        ++recomputed_;
    }
    if (!last_) cuda::copy_2d(ctx, model_.stage_grad(), 0, grad_in_, 0, buf_.row_bytes, 1);
    model_.enqueue_backward(ctx, sc);
    resident_ = -1;
}

void CudaPipeline::exchange(const ExecContext& ctx, bool send_fwd, bool recv_bwd, bool send_bwd,
                            bool recv_fwd) {
    const int next = last_ ? -1 : stage_ + 1, prev = first_ ? -1 : stage_ - 1;
    // With the next stage: the forward message out, the gradient of it back.
    if ((send_fwd || recv_bwd) && next >= 0)
        pp_.device_sendrecv(send_, send_fwd ? buf_.message_bytes : 0, send_fwd ? next : -1,
                            grad_in_, recv_bwd ? buf_.row_bytes : 0, recv_bwd ? next : -1,
                            ctx.stream);
    // With the previous stage: the input's gradient back, the next forward message in (into
    // the ring slot of the micro-batch it belongs to: they arrive in order).
    if ((send_bwd || recv_fwd) && prev >= 0) {
        pp_.device_sendrecv(model_.stage_grad(), send_bwd ? buf_.row_bytes : 0,
                            send_bwd ? prev : -1, ring(received_),
                            recv_fwd ? buf_.message_bytes : 0, recv_fwd ? prev : -1, ctx.stream);
        if (recv_fwd) ++received_;
    }
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
    resident_ = -1, received_ = 0, recomputed_ = 0;
    if (!sc.backward) {
        for (int64_t i = 0; i < n; ++i) {
            exchange(ctx, false, false, false, true);
            forward(ctx, sc, i, inputs, sums, true);
            exchange(ctx, true, false, false, false);
        }
        return;
    }
    auto backward_of = [&](int64_t i) {
        if (i == n - 1 && before_last_backward) before_last_backward();
        backward(ctx, sc, i, inputs);
    };
    const int64_t warm = std::min<int64_t>(stages_ - stage_ - 1, n), steady = n - warm;
    // A forward's activations serve its backward when that backward comes next: every forward
    // on the last stage (no warm-up), or the only micro-batch; the others are run again before
    // their backward (backward()), so they keep nothing for it.
    const bool kept = warm == 0 || n == 1;
    for (int64_t i = 0; i < warm; ++i) {
        exchange(ctx, false, false, false, true);
        forward(ctx, sc, i, inputs, sums, kept);
        exchange(ctx, true, false, false, false);
    }
    if (steady > 0) exchange(ctx, false, false, false, true);
    for (int64_t i = 0; i < steady; ++i) {
        forward(ctx, sc, warm + i, inputs, sums, kept);
        exchange(ctx, true, true, false, false);
        backward_of(i);
        exchange(ctx, false, false, true, i != steady - 1);
    }
    for (int64_t i = steady; i < n; ++i) {
        exchange(ctx, false, true, false, false);
        backward_of(i);
        exchange(ctx, false, false, true, false);
    }
}

}  // namespace sparsetron
