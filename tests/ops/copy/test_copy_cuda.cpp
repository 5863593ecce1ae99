// The copy family on CUDA: slot copies through a device index, replayed from one captured graph
// for every slot (what a step's staged micro-batches use under dynamic context parallelism).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gpu/harness.h"
#include "sparsetron/ops/copy/copy.h"

#if SPARSETRON_WITH_CUDA
#include "gpu/cuda_session_test.h"
#include "sparsetron/cuda/step_graph.h"
#endif

using namespace sparsetron;
using namespace sparsetron::test;

#if !SPARSETRON_WITH_CUDA
TEST(CopyCuda, Skipped) {
    GTEST_SKIP() << "built without CUDA: the CUDA op tests run on the GPU machine";
}
#else

class CopyCuda : public CudaSessionTest {};

// One graph of (block <- slot *i; sums[*i] <- block's first words; *i += 1) replayed once per
// slot moves slot s into the block and back out to sums row s, for every s in turn.
TEST_F(CopyCuda, SlotCopiesFollowTheDeviceIndexAcrossReplays) {
    const int64_t slots = 5, words = 1037, out_words = 6;
    std::vector<int32_t> host(size_t(slots * words));
    for (size_t i = 0; i < host.size(); ++i) host[i] = int32_t(i * 2654435761u % 100003);
    DeviceArray<int32_t> staged(host), block(words), sums(slots * out_words), index(1);
    cuda::zero(ctx(), sums.get(), slots * out_words * 4);
    cuda::zero(ctx(), index.get(), 4);
    cuda::StepGraph graph(*session_);
    graph.begin_capture();
    cuda::copy_from_slot(ctx(), block.get(), staged.get(), words * 4, index.get());
    cuda::copy_to_slot(ctx(), sums.get(), block.get(), out_words * 4, index.get());
    cuda::increment(ctx(), index.get());
    graph.end_capture();
    for (int64_t s = 0; s < slots; ++s) {
        graph.replay();
        sync();
        const std::vector<int32_t> got = block.download();
        for (int64_t w = 0; w < words; ++w)
            ASSERT_EQ(got[size_t(w)], host[size_t(s * words + w)]) << "slot " << s << " word " << w;
    }
    sync();
    const std::vector<int32_t> out = sums.download(), at = index.download();
    EXPECT_EQ(at[0], slots);
    for (int64_t s = 0; s < slots; ++s)
        for (int64_t w = 0; w < out_words; ++w)
            EXPECT_EQ(out[size_t(s * out_words + w)], host[size_t(s * words + w)])
                << "sums row " << s;
}

#endif
