#include "sparsetron/runtime/pipeline_timetable.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "sparsetron/core/error.h"

namespace sparsetron {

std::vector<PipelineWork> pipeline_rank_order(int rank, int ranks, int chunks, int64_t n,
                                              bool backward) {
    ST_CHECK(ranks >= 1 && chunks >= 1 && rank >= 0 && rank < ranks && n >= 0,
             "pipeline order: rank ", rank, " of ", ranks, ", ", chunks, " chunks");
    std::vector<PipelineWork> out;
    if (chunks == 1) {
        if (!backward) {
            for (int64_t i = 0; i < n; ++i) out.push_back({false, i, 0});
            return out;
        }
        const int64_t warm = std::min<int64_t>(ranks - rank - 1, n);
        for (int64_t i = 0; i < warm; ++i) out.push_back({false, i, 0});
        for (int64_t i = 0; i + warm < n; ++i) {
            out.push_back({false, warm + i, 0});
            out.push_back({true, i, 0});
        }
        for (int64_t i = n - warm; i < n; ++i) out.push_back({true, i, 0});
        return out;
    }
    ST_CHECK(n % ranks == 0, "interleaved pipeline stages: ", n,
             " micro-batches are not a multiple of the ", ranks, " pipeline ranks");
    // Virtual micro-batch k: micro-batches in groups of P, each group through every chunk in
    // turn (forwards in chunk order, backwards from the last chunk).
    const int64_t group = int64_t(ranks) * chunks, total = n * chunks;
    const auto work = [&](int64_t k, bool bwd) {
        const int c = int((k % group) / ranks);
        return PipelineWork{bwd, (k / group) * ranks + k % ranks, bwd ? chunks - 1 - c : c};
    };
    if (!backward) {
        for (int64_t k = 0; k < total; ++k) out.push_back(work(k, false));
        return out;
    }
    // Megatron runs every forward first when n == P; here the warm-up formula holds for any n,
    // so the last stage still runs each backward right after its forward (the model computes the
    // head's gradient with the forward).
    const int64_t warm =
        std::min<int64_t>(2 * int64_t(ranks - rank - 1) + int64_t(chunks - 1) * ranks, total);
    for (int64_t k = 0; k < warm; ++k) out.push_back(work(k, false));
    for (int64_t k = 0; k + warm < total; ++k) {
        out.push_back(work(warm + k, false));
        out.push_back(work(k, true));
    }
    for (int64_t k = total - warm; k < total; ++k) out.push_back(work(k, true));
    if (rank == ranks - 1)
        for (size_t i = 0; i < out.size(); ++i)
            if (!out[i].backward && out[i].chunk == chunks - 1)
                ST_ASSERT(i + 1 < out.size() && out[i + 1].backward &&
                              out[i + 1].micro_batch == out[i].micro_batch &&
                              out[i + 1].chunk == chunks - 1,
                          "pipeline order: the last stage's backward must follow its forward");
    return out;
}

PipelineTimetable::PipelineTimetable(int ranks, int chunks, int64_t n, bool backward)
    : ranks_(ranks), chunks_(chunks) {
    const int stages = ranks * chunks;
    for (int r = 0; r < ranks; ++r)
        orders_.push_back(pipeline_rank_order(r, ranks, chunks, n, backward));
    // The tick each (backward, micro-batch, stage) finished.
    std::map<std::tuple<bool, int64_t, int>, int64_t> done;
    const auto finished_before = [&](bool bwd, int64_t mb, int stage, int64_t t) {
        const auto it = done.find({bwd, mb, stage});
        return it != done.end() && it->second < t;
    };
    std::vector<size_t> next(size_t(ranks), 0);
    slot_.assign(size_t(ranks), {});
    for (int64_t t = 0;; ++t) {
        bool left = false, ran = false;
        std::vector<std::tuple<bool, int64_t, int>> now;
        for (int r = 0; r < ranks; ++r) {
            slot_[size_t(r)].push_back(-1);
            if (next[size_t(r)] == orders_[size_t(r)].size()) continue;
            left = true;
            const PipelineWork& w = orders_[size_t(r)][next[size_t(r)]];
            const int s = stage_of(r, w.chunk);
            const bool ready = !w.backward
                                   ? s == 0 || finished_before(false, w.micro_batch, s - 1, t)
                               : s == stages - 1 ? finished_before(false, w.micro_batch, s, t)
                                                 : finished_before(true, w.micro_batch, s + 1, t);
            if (!ready) continue;
            slot_[size_t(r)].back() = int64_t(next[size_t(r)]++);
            now.emplace_back(w.backward, w.micro_batch, s);
            ran = true;
        }
        if (!left) {
            for (auto& s : slot_) s.pop_back();
            ticks_ = t;
            break;
        }
        ST_ASSERT(ran, "pipeline timetable: no rank can run at tick ", t, " (", ranks, " ranks, ",
                  chunks, " chunks, ", n, " micro-batches)");
        for (const auto& k : now) done[k] = t;
    }
    // What each rank holds: messages between arrival and use, activations between a forward and
    // a backward that does not follow it at once.
    held_messages_.assign(size_t(ranks), 0);
    kept_.assign(size_t(ranks), 0);
    held_inputs_.assign(size_t(ranks), 0);
    held_gradients_.assign(size_t(ranks), 0);
    keep_.assign(size_t(ranks), {});
    for (int r = 0; r < ranks; ++r) {
        const auto& order = orders_[size_t(r)];
        std::vector<int64_t> tick_of(order.size());
        for (int64_t t = 0; t < ticks_; ++t)
            if (slot_[size_t(r)][size_t(t)] >= 0) tick_of[size_t(slot_[size_t(r)][size_t(t)])] = t;
        const auto tick_of_work = [&](bool bwd, int64_t mb, int chunk) {
            const auto it = std::find_if(order.begin(), order.end(), [&](const PipelineWork& o) {
                return o.backward == bwd && o.micro_batch == mb && o.chunk == chunk;
            });
            ST_ASSERT(it != order.end(), "pipeline timetable: a message no work reads");
            return tick_of[size_t(it - order.begin())];
        };
        // (tick, +1 arrival / -1 use): every message until its use; forward messages until
        // the backward of the work they feed, and gradients until theirs.
        std::vector<std::pair<int64_t, int>> events, inputs, grads;
        for (int64_t t = 0; t < ticks_; ++t)
            for (bool fwd : {true, false}) {
                PipelineWork w;
                if (!receives(r, t, fwd, &w)) continue;
                events.emplace_back(t, 1);
                events.emplace_back(tick_of_work(w.backward, w.micro_batch, w.chunk), -1);
                auto& held = fwd ? inputs : grads;
                held.emplace_back(t, 1);
                held.emplace_back(tick_of_work(backward, w.micro_batch, w.chunk), -1);
            }
        keep_[size_t(r)].assign(order.size(), false);
        std::vector<std::pair<int64_t, int>> kept;
        for (size_t i = 0; i < order.size(); ++i) {
            if (order[i].backward || !backward) continue;
            const bool next_is_mine = i + 1 < order.size() && order[i + 1].backward &&
                                      order[i + 1].micro_batch == order[i].micro_batch &&
                                      order[i + 1].chunk == order[i].chunk;
            if (next_is_mine) continue;
            keep_[size_t(r)][i] = true;
            for (size_t j = i + 1; j < order.size(); ++j)
                if (order[j].backward && order[j].micro_batch == order[i].micro_batch &&
                    order[j].chunk == order[i].chunk) {
                    kept.emplace_back(tick_of[i], 1);
                    kept.emplace_back(tick_of[j], -1);
                    break;
                }
        }
        const auto most = [](std::vector<std::pair<int64_t, int>> e) {
            // A use at tick t frees its slot before an arrival at the end of tick t.
            std::sort(e.begin(), e.end(), [](const auto& a, const auto& b) {
                return a.first != b.first ? a.first < b.first : a.second < b.second;
            });
            int64_t live = 0, peak = 0;
            for (const auto& [t, d] : e) peak = std::max(peak, live += d);
            return peak;
        };
        held_messages_[size_t(r)] = most(events);
        held_inputs_[size_t(r)] = most(inputs);
        held_gradients_[size_t(r)] = most(grads);
        kept_[size_t(r)] = most(kept);
    }
}

const PipelineWork* PipelineTimetable::at(int r, int64_t t) const {
    if (t < 0 || t >= ticks_) return nullptr;
    const int64_t i = slot_[size_t(r)][size_t(t)];
    return i < 0 ? nullptr : &orders_[size_t(r)][size_t(i)];
}

bool PipelineTimetable::sends(int r, const PipelineWork& w) const {
    const int s = stage_of(r, w.chunk);
    return w.backward ? s > 0 : s < ranks_ * chunks_ - 1;
}

bool PipelineTimetable::reads_message(int r, const PipelineWork& w) const {
    const int s = stage_of(r, w.chunk);
    return w.backward ? s < ranks_ * chunks_ - 1 : s > 0;
}

PipelineTimetable::RingShift PipelineTimetable::ring_shift(int r, int64_t t, bool forward) const {
    RingShift s;
    const PipelineWork* w = at(r, t);
    s.send = w && w->backward != forward && sends(r, *w);
    s.recv = receives(r, t, forward, &s.feeds);
    const int next = (r + 1) % ranks_, prev = (r + ranks_ - 1) % ranks_;
    if (s.send) s.to = forward ? next : prev;
    if (s.recv) s.from = forward ? prev : next;
    return s;
}

bool PipelineTimetable::receives(int r, int64_t t, bool forward, PipelineWork* feeds) const {
    if (ranks_ == 1) return false;  // one stage: no message
    const int from = forward ? (r + ranks_ - 1) % ranks_ : (r + 1) % ranks_;
    const PipelineWork* w = at(from, t);
    if (!w || w->backward == forward || !sends(from, *w)) return false;
    const int to_stage = stage_of(from, w->chunk) + (forward ? 1 : -1);
    ST_ASSERT(to_stage % ranks_ == r, "pipeline timetable: a message to another rank");
    if (feeds) *feeds = PipelineWork{!forward, w->micro_batch, to_stage / ranks_};
    return true;
}

}  // namespace sparsetron
