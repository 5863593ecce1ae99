#include "sparsetron/runtime/cpu/pipeline_schedule.h"

#include <cstring>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

// A micro-batch's losses from two of a rank's stages (other layers of the same micro-batch).
void add_losses(LossSums& into, const LossSums& s) {
    into.lm_loss_sum += s.lm_loss_sum;
    into.lm_targets += s.lm_targets;
    if (into.mtp_sum.empty()) into.mtp_sum.assign(s.mtp_sum.size(), 0.0);
    if (into.mtp_count.empty()) into.mtp_count.assign(s.mtp_count.size(), 0);
    for (size_t k = 0; k < s.mtp_sum.size(); ++k) into.mtp_sum[k] += s.mtp_sum[k];
    for (size_t k = 0; k < s.mtp_count.size(); ++k) into.mtp_count[k] += s.mtp_count[k];
    into.mtp_acceptance_sum += s.mtp_acceptance_sum;
    into.indexer_loss += s.indexer_loss;
    into.indexer_layers.insert(into.indexer_layers.end(), s.indexer_layers.begin(),
                               s.indexer_layers.end());
    into.aux_loss += s.aux_loss;
    into.mtp_aux_loss += s.mtp_aux_loss;
}

}  // namespace

PipelineSchedule::PipelineSchedule(std::vector<Glm5Model<float>*> stages, Comm& pp,
                                   int64_t microbatches)
    : stages_(std::move(stages)), pp_(pp), rank_(pp.rank()), ranks_(pp.size()) {
    ST_CHECK(!stages_.empty(), "pipeline: a rank with no stage");
    for (size_t v = 0; v < stages_.size(); ++v) {
        const PipelineStage& s = stages_[v]->stage();
        ST_CHECK(s.index == int(v) * ranks_ + rank_ && s.count == ranks_ * int(stages_.size()),
                 "pipeline: the model holds stage ", s.index, " of ", s.count, " but this rank's ",
                 "chunk ", v, " is stage ", int(v) * ranks_ + rank_, " of ",
                 ranks_ * int(stages_.size()));
    }
    const Glm5Model<float>& m = *stages_.front();
    row_bytes_ = m.tokens() * m.config().hidden_size * int64_t(sizeof(float));
    reserve(timetable(microbatches, true));
}

const PipelineTimetable& PipelineSchedule::timetable(int64_t n, bool backward) {
    auto& tt = timetables_[{n, backward}];
    if (!tt) tt = std::make_unique<PipelineTimetable>(ranks_, int(stages_.size()), n, backward);
    return *tt;
}

void PipelineSchedule::reserve(const PipelineTimetable& tt) {
    while (int64_t(messages_.size()) < tt.held_messages(rank_))
        messages_.emplace_back(size_t(row_bytes_));
    while (int64_t(kept_.size()) < tt.kept_activations(rank_)) {
        kept_.emplace_back();
        kept_.back().bytes.resize(stages_.front()->activation_bytes());
    }
}

void PipelineSchedule::shift(const PipelineTimetable& tt, int64_t t, const PipelineWork* w,
                             bool forward) {
    const PipelineTimetable::RingShift s = tt.ring_shift(rank_, t, forward);
    if (!s.send && !s.recv) return;
    const void* out = nullptr;
    if (s.send)
        out = forward ? static_cast<const void*>(stages_[size_t(w->chunk)]->stage_output())
                      : static_cast<const void*>(stages_[size_t(w->chunk)]->stage_grad());
    char* in = nullptr;
    if (s.recv) {
        ST_ASSERT(!free_messages_.empty(), "pipeline: more messages held than the timetable says");
        const size_t slot = free_messages_.back();
        free_messages_.pop_back();
        message_at_[{s.feeds.backward, s.feeds.micro_batch, s.feeds.chunk}] = slot;
        in = messages_[slot].data();
    }
    pp_.sendrecv(out, s.send ? row_bytes_ : 0, s.to, in, s.recv ? row_bytes_ : 0, s.from);
}

std::vector<LossSums> PipelineSchedule::run(const std::vector<const MicroBatch*>& mbs,
                                            const std::vector<Comm*>* cps, const LossScales& sc) {
    const int64_t n = int64_t(mbs.size());
    const PipelineTimetable& tt = timetable(n, sc.backward);
    reserve(tt);  // a count of micro-batches not seen before (validation's) grows them once
    message_at_.clear(), kept_at_.clear();
    free_messages_.clear(), free_kept_.clear();
    for (size_t i = messages_.size(); i-- > 0;) free_messages_.push_back(i);
    for (size_t i = kept_.size(); i-- > 0;) free_kept_.push_back(i);
    std::vector<LossSums> out(static_cast<size_t>(n));
    // Copies the message work w reads into its model, and frees its buffer.
    const auto take = [&](const PipelineWork& w, void* into) {
        const auto it = message_at_.find({w.backward, w.micro_batch, w.chunk});
        ST_ASSERT(it != message_at_.end(), "pipeline: a message the timetable did not deliver");
        std::memcpy(into, messages_[it->second].data(), size_t(row_bytes_));
        free_messages_.push_back(it->second);
        message_at_.erase(it);
    };
    for (int64_t t = 0; t < tt.ticks(); ++t) {
        const PipelineWork* w = tt.at(rank_, t);
        if (w) {
            Glm5Model<float>& m = *stages_[size_t(w->chunk)];
            const int64_t i = w->micro_batch;
            if (!w->backward) {
                if (cps) m.set_context_parallel((*cps)[size_t(i)]);
                m.load_inputs(*mbs[size_t(i)]);
                if (tt.reads_message(rank_, *w)) take(*w, m.stage_input());
                add_losses(out[size_t(i)], m.forward(sc));
                if (tt.keeps(rank_, tt.index_at(rank_, t))) {
                    ST_ASSERT(!free_kept_.empty(), "pipeline: more forwards kept than planned");
                    const size_t slot = free_kept_.back();
                    free_kept_.pop_back();
                    kept_at_[{i, w->chunk}] = slot;
                    m.save_activations(kept_[slot]);
                }
            } else {
                const auto it = kept_at_.find({i, w->chunk});
                if (it != kept_at_.end()) {
                    m.restore_activations(kept_[it->second]);
                    free_kept_.push_back(it->second);
                    kept_at_.erase(it);
                }
                if (tt.reads_message(rank_, *w)) take(*w, m.stage_grad());
                m.backward(sc);
            }
        }
        shift(tt, t, w, true);
        shift(tt, t, w, false);
    }
    ST_ASSERT(message_at_.empty() && kept_at_.empty(), "pipeline: a step left work held");
    return out;
}

}  // namespace sparsetron
