// Pipeline parallelism's schedule on one stage (SPEC §10): 1F1B over the step's micro-batches
// (Megatron's non-interleaved schedule, PipeDream-Flush). Stage s of S runs min(S - s - 1, n)
// warm-up forwards, then alternates one forward and one backward, then drains the backwards;
// activations travel to the next stage after each forward and their gradients come back before
// each backward. Two stages exchanging in opposite directions do it in one sendrecv (Megatron's
// send_forward_recv_backward / send_backward_recv_forward), so no pair waits on the other.
//
// The CPU model holds one micro-batch's activations in its plan; the micro-batches in flight
// (up to S - s) are kept as snapshots taken after their forward and restored before their
// backward, allocated once. A forward message is the stage's output rows (no top-k: every stage
// starts on a layer that computes its own, check_index_share_pipeline_split).
#pragma once

#include <vector>

#include "sparsetron/data/packer.h"
#include "sparsetron/model/glm5_model.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

class PipelineSchedule {
  public:
    // `pp`: one rank per stage, in stage order (the layout's pipeline group).
    PipelineSchedule(Glm5Model<float>& model, Comm& pp);

    // Every micro-batch through this stage: forward and backward when scales.backward, forward
    // only otherwise. `cps` (optional): each micro-batch's CP communicator (dynamic CP). Returns
    // each micro-batch's losses as this stage sees them (the head's and MTP's on the last stage,
    // the indexer and aux losses of this stage's layers everywhere).
    std::vector<LossSums> run(const std::vector<const MicroBatch*>& mbs,
                              const std::vector<Comm*>* cps, const LossScales& scales);

    int stage() const { return stage_; }
    int stages() const { return stages_; }

  private:
    void pack_forward();
    void unpack_forward();
    // One transfer with the previous (prev) or next stage; absent neighbours are skipped.
    void exchange(bool send_fwd, bool recv_bwd, bool send_bwd, bool recv_fwd);

    Glm5Model<float>& model_;
    Comm& pp_;
    int stage_, stages_;
    int64_t row_bytes_;
    std::vector<char> send_, recv_;  // forward messages out and in
    std::vector<Glm5Model<float>::ActivationSnapshot> stash_;
};

}  // namespace sparsetron
