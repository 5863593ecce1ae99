#include "sparsetron/runtime/cpu/pipeline_schedule.h"

#include <algorithm>
#include <cstring>

#include "sparsetron/core/error.h"

namespace sparsetron {

PipelineSchedule::PipelineSchedule(Glm5Model<float>& model, Comm& pp)
    : model_(model), pp_(pp), stage_(pp.rank()), stages_(pp.size()) {
    ST_CHECK(model.stage().index == stage_ && model.stage().count == stages_,
             "pipeline: the model holds stage ", model.stage().index, " of ", model.stage().count,
             " but this rank is stage ", stage_, " of ", stages_);
    const int64_t T = model.tokens(), h = model.config().hidden_size;
    row_bytes_ = T * h * int64_t(sizeof(float));
    const size_t message = size_t(row_bytes_);
    if (!model.stage().last()) send_.resize(message);
    if (!model.stage().first()) recv_.resize(message);
    // Micro-batches in flight on stage s: its warm-up forwards and the one before the first
    // backward; the last stage runs each backward right after its forward.
    if (!model.stage().last()) {
        stash_.resize(size_t(stages_ - stage_));
        for (auto& s : stash_) s.bytes.resize(model.activation_bytes());
    }
}

void PipelineSchedule::pack_forward() {
    char* p = send_.data();
    std::memcpy(p, model_.stage_output(), size_t(row_bytes_));
}

void PipelineSchedule::unpack_forward() {
    const char* p = recv_.data();
    std::memcpy(model_.stage_input(), p, size_t(row_bytes_));
}

void PipelineSchedule::exchange(bool send_fwd, bool recv_bwd, bool send_bwd, bool recv_fwd) {
    const bool first = stage_ == 0, last = stage_ == stages_ - 1;
    const int next = last ? -1 : stage_ + 1, prev = first ? -1 : stage_ - 1;
    const int64_t message = row_bytes_;
    // With the next stage: the forward message out, the gradient of it back.
    if ((send_fwd || recv_bwd) && next >= 0)
        pp_.sendrecv(send_.data(), send_fwd ? message : 0, send_fwd ? next : -1,
                     model_.stage_grad(), recv_bwd ? row_bytes_ : 0, recv_bwd ? next : -1);
    // With the previous stage: the input's gradient back, the next forward message in.
    if ((send_bwd || recv_fwd) && prev >= 0)
        pp_.sendrecv(model_.stage_grad(), send_bwd ? row_bytes_ : 0, send_bwd ? prev : -1,
                     recv_.data(), recv_fwd ? message : 0, recv_fwd ? prev : -1);
}

std::vector<LossSums> PipelineSchedule::run(const std::vector<const MicroBatch*>& mbs,
                                            const std::vector<Comm*>* cps, const LossScales& sc) {
    const int64_t n = int64_t(mbs.size());
    std::vector<LossSums> out(static_cast<size_t>(n));
    const bool first = stage_ == 0;
    auto forward = [&](int64_t i, bool keep) {
        if (cps) model_.set_context_parallel((*cps)[size_t(i)]);
        model_.load_inputs(*mbs[size_t(i)]);
        if (!first) unpack_forward();
        out[size_t(i)] = model_.forward(sc);
        if (!model_.stage().last()) pack_forward();
        if (keep) model_.save_activations(stash_[size_t(i) % stash_.size()]);
    };
    if (!sc.backward) {
        for (int64_t i = 0; i < n; ++i) {
            exchange(false, false, false, true);
            forward(i, false);
            exchange(true, false, false, false);
        }
        return out;
    }
    const int64_t warm = std::min<int64_t>(stages_ - stage_ - 1, n), steady = n - warm;
    const bool stash = warm > 0;  // else each backward follows its forward at once
    auto backward = [&](int64_t i) {
        if (stash) model_.restore_activations(stash_[size_t(i) % stash_.size()]);
        model_.backward(sc);
    };
    for (int64_t i = 0; i < warm; ++i) {
        exchange(false, false, false, true);
        forward(i, stash);
        exchange(true, false, false, false);
    }
    if (steady > 0) exchange(false, false, false, true);
    for (int64_t i = 0; i < steady; ++i) {
        forward(warm + i, stash);
        exchange(true, true, false, false);
        backward(i);
        const bool last_steady = i == steady - 1;
        exchange(false, false, true, !last_steady);
    }
    for (int64_t i = steady; i < n; ++i) {
        exchange(false, true, false, false);
        backward(i);
        exchange(false, false, true, false);
    }
    return out;
}

}  // namespace sparsetron
