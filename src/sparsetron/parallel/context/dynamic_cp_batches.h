// One step under dynamic context parallelism, on one rank: every rank computes the same schedule
// of the step's documents (dynamic_cp.h) and packs the groups that hold it, each into a
// micro-batch of its own with the group's CP communicator. With expert parallelism every
// micro-batch's MoE layers exchange rows over the EP group, whose ranks may sit in different CP
// groups: a rank the schedule leaves idle in a micro-batch runs an empty one (no documents:
// nothing routed, no loss), so that it joins the same exchanges in the same order as its peers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "sparsetron/config/run_config.h"
#include "sparsetron/data/packer.h"
#include "sparsetron/parallel/layout/process_groups.h"

namespace sparsetron {

class DynamicCpBatches {
  public:
    // Micro-batches of `slots` token slots and `max_documents` documents (the largest group's);
    // `groups`: the layout's communicators (null with one rank), `rank` of `ranks` the stage's.
    // `multiple`: a rank's micro-batches per step padded with empty ones to a multiple of it
    // (interleaved pipeline stages take micro-batches in groups of the pipeline's ranks; a
    // rank's pipeline peers hold its place in their stages, so they pad alike).
    DynamicCpBatches(const RunConfig& run, int64_t slots, int64_t max_documents,
                     const ProcessGroups* groups, int rank, int ranks, int64_t multiple = 1);

    struct Step {
        std::vector<const MicroBatch*> micro_batches;  // this rank's
        std::vector<Comm*> cp_groups;                  // each one's CP group (null: this rank)
        std::vector<int64_t> groups_by_size;           // every rank's groups, entry i: size 2^i
        int64_t idle_ranks = 0;                        // ranks left without a group, summed
    };
    // The step of the packed `batches` (every rank's, the same on every rank). The returned
    // micro-batches live until the next call.
    Step schedule(const std::vector<MicroBatch>& batches);

  private:
    MicroBatch& next_batch(size_t used);

    const RunConfig& run_;
    int64_t slots_, max_documents_;
    const ProcessGroups* groups_;
    int rank_, ranks_;
    int64_t multiple_;
    std::vector<std::unique_ptr<MicroBatch>> batches_;
};

}  // namespace sparsetron
