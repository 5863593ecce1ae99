// Pipeline parallelism's schedule on one CPU rank (SPEC §10): the rank's stages (one, or its
// chunks under interleaving) run the pipeline timetable (runtime/pipeline_timetable.h), one piece
// of work per tick: Megatron's 1F1B or its interleaved form. After each tick the forward message
// goes to the next rank and the input gradient to the previous one (two ring shifts, each one
// sendrecv); a message is held until the work it feeds runs.
//
// All the rank's stage models share one plan, so the activations of every micro-batch a forward
// leaves for a later backward are kept as a snapshot of the plan's activations (and what the
// layers keep on the host), taken after the forward and restored before the backward; buffers
// for the most snapshots and messages the timetable holds at once are allocated once.
#pragma once

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "sparsetron/data/packer.h"
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/runtime/pipeline_timetable.h"

namespace sparsetron {

class PipelineSchedule {
  public:
    // `stages`: this rank's stage models in its order (chunk 0 first); `pp`: one rank per
    // pipeline rank, in order. `microbatches`: a training step's count (its buffers now).
    PipelineSchedule(std::vector<Glm5Model<float>*> stages, Comm& pp, int64_t microbatches);

    // Every micro-batch through this rank's stages: forward and backward when scales.backward,
    // forward only otherwise. `cps` (optional): each micro-batch's CP communicator (dynamic CP).
    // Returns each micro-batch's losses as this rank's stages see them (the head's and MTP's on
    // the last stage, the indexer and aux losses of the rank's layers everywhere).
    std::vector<LossSums> run(const std::vector<const MicroBatch*>& mbs,
                              const std::vector<Comm*>* cps, const LossScales& scales);

  private:
    const PipelineTimetable& timetable(int64_t n, bool backward);
    void reserve(const PipelineTimetable& tt);
    // One ring shift after tick t: forward messages to the next rank, or gradients to the
    // previous one (this rank's work `w` sends; a neighbour's may arrive).
    void shift(const PipelineTimetable& tt, int64_t t, const PipelineWork* w, bool forward);

    std::vector<Glm5Model<float>*> stages_;
    Comm& pp_;
    int rank_, ranks_;
    int64_t row_bytes_;
    std::map<std::pair<int64_t, bool>, std::unique_ptr<PipelineTimetable>> timetables_;
    std::vector<std::vector<char>> messages_;  // received, not yet read
    std::vector<Glm5Model<float>::ActivationSnapshot> kept_;
    // During a run: where each held message and snapshot sits; the free ones.
    std::map<std::tuple<bool, int64_t, int>, size_t> message_at_;
    std::map<std::pair<int64_t, int>, size_t> kept_at_;
    std::vector<size_t> free_messages_, free_kept_;
};

}  // namespace sparsetron
