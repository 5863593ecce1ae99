// The work of a pipeline step on every rank, in ticks (SPEC §10), from Megatron's schedules:
// 1F1B (PipeDream-Flush) with one stage per rank, its interleaved form with V chunks per rank
// (the model cut into V x P stages; rank r holds stages r, P + r, ...). Each rank's order is
// Megatron's; the timetable places every piece of work at the first tick where its input exists
// (the forward message of the stage before, the gradient of the stage after), so an executor runs
// one piece per rank and tick and then delivers that tick's messages: forward messages to the next
// rank (the ring's: the last rank's go to rank 0's next chunk), gradients to the previous. Every
// rank builds the same timetable, so a sender and its receiver agree on each message without
// naming it, and a tick's transfers are two ring shifts that cannot wait on each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparsetron {

struct PipelineWork {
    bool backward = false;
    int64_t micro_batch = 0;
    int chunk = 0;  // the rank's chunk: stage chunk x P + rank
};

// Rank `rank`'s order of `n` micro-batches through its `chunks` chunks: forwards only, or 1F1B's
// warm-up forwards, one forward and one backward in turn, then the remaining backwards (with
// interleaving Megatron's: micro-batches in groups of P through each chunk in turn, a warm-up of
// 2 (P - rank - 1) + (chunks - 1) P; n a multiple of P). The last stage runs each backward right
// after its forward (Megatron's all-forwards-first case for n = P is not taken: the head's
// gradient is computed with the forward).
std::vector<PipelineWork> pipeline_rank_order(int rank, int ranks, int chunks, int64_t n,
                                              bool backward);

class PipelineTimetable {
  public:
    // Throws if the orders cannot all finish (a bug in the schedule, never in the data).
    PipelineTimetable(int ranks, int chunks, int64_t n, bool backward);

    int64_t ticks() const { return ticks_; }
    // Rank r's work at tick t, or nullptr when it waits.
    const PipelineWork* at(int r, int64_t t) const;
    // Whether work w of rank r sends a message after it: a forward's output to the next stage,
    // a backward's input gradient to the stage before.
    bool sends(int r, const PipelineWork& w) const;
    // The message rank r receives at the end of tick t from its previous rank (a forward
    // message, true when `forward`) or from its next (a gradient), and the work of r it feeds.
    bool receives(int r, int64_t t, bool forward, PipelineWork* feeds) const;
    // One ring shift after tick t as rank r takes part in it: whether its work sends (a forward
    // message to the next rank, or a gradient to the previous: `to`) and whether a message
    // arrives (from the previous rank, or the next: `from`), with the work of r it feeds.
    struct RingShift {
        bool send = false, recv = false;
        int to = -1, from = -1;
        PipelineWork feeds;
    };
    RingShift ring_shift(int r, int64_t t, bool forward) const;
    // Whether work i of rank r's order needs its input from a message (not the embedding's rows,
    // and for a backward not the head's own gradient).
    bool reads_message(int r, const PipelineWork& w) const;
    // The most messages rank r holds at once between their arrival and their use, and the most
    // forwards whose activations it keeps for a backward that does not follow at once.
    int64_t held_messages(int r) const { return held_messages_[size_t(r)]; }
    // The same when a forward message is kept until the backward of the work it feeds (the
    // CUDA pipeline runs a chunk's forward again from it): the most forward messages and the
    // most gradient messages rank r holds at once.
    int64_t held_inputs(int r) const { return held_inputs_[size_t(r)]; }
    int64_t held_gradients(int r) const { return held_gradients_[size_t(r)]; }
    int64_t kept_activations(int r) const { return kept_[size_t(r)]; }
    // Whether rank r keeps the activations of its i-th work (a forward) for a later backward.
    bool keeps(int r, int64_t i) const { return keep_[size_t(r)][size_t(i)]; }
    const std::vector<PipelineWork>& order(int r) const { return orders_[size_t(r)]; }
    // The index in order(r) of rank r's work at tick t, or -1.
    int64_t index_at(int r, int64_t t) const { return slot_[size_t(r)][size_t(t)]; }

  private:
    int stage_of(int r, int chunk) const { return chunk * ranks_ + r; }
    int ranks_, chunks_;
    int64_t ticks_ = 0;
    std::vector<std::vector<PipelineWork>> orders_;
    std::vector<std::vector<int64_t>> slot_;  // [rank][tick] -> index in the order, or -1
    std::vector<std::vector<bool>> keep_;
    std::vector<int64_t> held_messages_, kept_, held_inputs_, held_gradients_;
};

}  // namespace sparsetron
