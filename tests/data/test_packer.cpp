#include <gtest/gtest.h>

#include <map>

#include "sparsetron/data/packer.h"
#include "test_util.h"

using namespace sparsetron;

namespace {
std::string make_dataset(const std::string& dir, std::vector<std::vector<int32_t>>& docs) {
    CounterRng rng(11, 2);
    for (int d = 0; d < 40; ++d) {
        // Lengths from 1 to 150 so documents both fit and get cut at the 64-slot boundary.
        std::vector<int32_t> doc(1 + rng.bits(d) % 150);
        for (size_t i = 0; i < doc.size(); ++i) doc[i] = 1000 * d + static_cast<int32_t>(i) + 1;
        docs.push_back(doc);
    }
    IndexedDatasetWriter w(dir + "/ds", TokenCode::I32);
    for (const auto& d : docs) w.add_document(d);
    w.finish();
    return dir + "/ds";
}
}  // namespace

TEST(Packer, InvariantsHoldOverManyMicroBatches) {
    std::vector<std::vector<int32_t>> docs;
    std::string prefix = make_dataset(test::temp_dir("p"), docs);
    DocumentStream stream({prefix}, 4);
    const int64_t cap = 64, max_docs = 3;
    Packer packer(stream, cap, max_docs);
    MicroBatch mb(cap, max_docs);
    std::map<int32_t, std::vector<int32_t>> seen;  // doc id -> tokens in stream order
    int64_t total_tokens = 0;
    for (int step = 0; step < 120; ++step) {
        packer.next(mb);
        ASSERT_GE(mb.num_documents, 1);
        ASSERT_LE(mb.num_documents, max_docs);
        // Either every slot is used or the document limit closed the batch: no slot lost.
        EXPECT_TRUE(mb.num_tokens == cap || mb.num_documents == max_docs);
        EXPECT_EQ(mb.cu_seqlens[0], 0);
        EXPECT_EQ(mb.cu_seqlens[mb.num_documents], mb.num_tokens);
        for (int64_t d = mb.num_documents; d <= max_docs; ++d)
            EXPECT_EQ(mb.cu_seqlens[d], mb.num_tokens);  // padded by repeating the last value
        for (int64_t d = 0; d < mb.num_documents; ++d) {
            int32_t b = mb.cu_seqlens[d], e = mb.cu_seqlens[d + 1];
            ASSERT_LT(b, e);
            int32_t doc_id = mb.tokens[b] / 1000;
            for (int32_t i = b; i < e; ++i) {
                EXPECT_EQ(mb.tokens[i] / 1000, doc_id) << "a segment crosses documents";
                EXPECT_EQ(mb.positions[i], i - b);
                EXPECT_EQ(mb.targets[i], i + 1 < e ? mb.tokens[i + 1] : -1);
                seen[doc_id].push_back(mb.tokens[i]);
            }
        }
        for (int64_t i = mb.num_tokens; i < cap; ++i) {
            EXPECT_EQ(mb.targets[i], -1);
            EXPECT_EQ(mb.tokens[i], 0);
        }
        total_tokens += mb.num_tokens;
        EXPECT_EQ(mb.num_targets(), mb.num_tokens - mb.num_documents);
    }
    // Reassembling the pieces gives back whole documents in order (the first epoch at least).
    int complete = 0;
    for (const auto& [id, toks] : seen) {
        const auto& doc = docs[id];
        for (size_t i = 0; i < toks.size(); ++i) ASSERT_EQ(toks[i], doc[i % doc.size()]);
        complete += toks.size() >= doc.size();
    }
    EXPECT_GT(complete, 30);
    EXPECT_GT(total_tokens, 120 * cap * 8 / 10);
}
