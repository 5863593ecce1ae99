#include "sparsetron/parallel/context/dynamic_cp_batches.h"

#include "sparsetron/core/error.h"
#include "sparsetron/parallel/context/dynamic_cp.h"

namespace sparsetron {
namespace {

// The step's samples: every document (piece) of the packed micro-batches.
struct StepSample {
    const MicroBatch* mb;
    int64_t begin, length;
};

std::vector<StepSample> step_samples(const std::vector<MicroBatch>& batches) {
    std::vector<StepSample> out;
    for (const MicroBatch& mb : batches)
        for (int64_t d = 0; d < mb.num_documents; ++d)
            out.push_back({&mb, mb.cu_seqlens[d], mb.cu_seqlens[d + 1] - mb.cu_seqlens[d]});
    return out;
}

}  // namespace

DynamicCpBatches::DynamicCpBatches(const RunConfig& run, int64_t slots, int64_t max_documents,
                                   const ProcessGroups* groups, int rank, int ranks,
                                   int64_t multiple)
    : run_(run),
      slots_(slots),
      max_documents_(max_documents),
      groups_(groups),
      rank_(rank),
      ranks_(ranks),
      multiple_(multiple) {
    ST_CHECK(multiple_ >= 1, "dynamic CP: micro-batches in multiples of ", multiple_);
}

MicroBatch& DynamicCpBatches::next_batch(size_t used) {
    if (used == batches_.size())
        batches_.push_back(std::make_unique<MicroBatch>(slots_, max_documents_));
    MicroBatch& mb = *batches_[used];
    mb.clear();
    return mb;
}

DynamicCpBatches::Step DynamicCpBatches::schedule(const std::vector<MicroBatch>& batches) {
    // A rank runs the groups that hold it, with CP = the group's size over the aligned
    // sub-communicator of that size (made once; none for a group of one rank).
    const bool join_exchanges = run_.expert_model_parallel_size > 1;
    const std::vector<StepSample> samples = step_samples(batches);
    std::vector<int64_t> lengths;
    for (const StepSample& s : samples) lengths.push_back(s.length);
    Step out;
    for (const auto& smb : schedule_dynamic_cp(lengths, ranks_, run_.max_seqlen_per_dp_cp_rank)) {
        out.idle_ranks += smb.idle_ranks;
        const size_t before = out.micro_batches.size();
        for (const DynamicCpGroup& g : smb.groups) {
            int bucket = 0;
            while ((1 << bucket) < g.size) ++bucket;
            if (int(out.groups_by_size.size()) <= bucket) out.groups_by_size.resize(bucket + 1);
            ++out.groups_by_size[size_t(bucket)];
            if (rank_ < g.first_rank || rank_ >= g.first_rank + g.size) continue;
            ST_ASSERT(g.first_rank % g.size == 0, "dynamic CP group not aligned");
            MicroBatch& mb = next_batch(out.micro_batches.size());
            for (int s : g.samples) {
                const StepSample& x = samples[size_t(s)];
                std::vector<int32_t> doc(x.mb->tokens.begin() + x.begin,
                                         x.mb->tokens.begin() + x.begin + x.length);
                ST_CHECK(mb.add_document(doc), "dynamic CP: a group's micro-batch holds more than ",
                         mb.max_documents, " documents (raise max_documents_per_microbatch)");
            }
            out.cp_groups.push_back(g.size > 1 ? &groups_->dynamic(g.size) : nullptr);
            out.micro_batches.push_back(&mb);
        }
        if (join_exchanges && out.micro_batches.size() == before) {
            out.micro_batches.push_back(&next_batch(out.micro_batches.size()));
            out.cp_groups.push_back(nullptr);
        }
    }
    // Empty micro-batches (no documents: no loss, nothing routed) up to the multiple.
    while (int64_t(out.micro_batches.size()) % multiple_ != 0) {
        out.micro_batches.push_back(&next_batch(out.micro_batches.size()));
        out.cp_groups.push_back(nullptr);
    }
    return out;
}

}  // namespace sparsetron
