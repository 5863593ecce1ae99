#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "sparsetron/core/error.h"
#include "sparsetron/data/byte_tokenizer.h"
#include "sparsetron/data/document_stream.h"
#include "sparsetron/data/indexed_dataset.h"
#include "sparsetron/data/split.h"
#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

std::vector<std::vector<int32_t>> sample_docs() {
    std::vector<std::vector<int32_t>> docs;
    CounterRng rng(5, 1);
    for (int d = 0; d < 23; ++d) {
        std::vector<int32_t> doc(1 + rng.bits(d) % 97);
        for (size_t i = 0; i < doc.size(); ++i) doc[i] = 1 + (rng.bits(1000 * d + i) % 60000);
        docs.push_back(doc);
    }
    return docs;
}

std::string write_dataset(const std::string& dir, TokenCode code = TokenCode::U16) {
    std::string prefix = dir + "/ds";
    IndexedDatasetWriter w(prefix, code);
    for (const auto& d : sample_docs()) w.add_document(d);
    w.finish();
    return prefix;
}

std::vector<char> read_file(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}
void write_file(const std::string& p, const std::vector<char>& b) {
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(b.data(), b.size());
}

PreprocessOptions options(std::vector<std::string> inputs, const std::string& prefix) {
    PreprocessOptions o;
    o.inputs = std::move(inputs);
    o.output_prefix = prefix;
    return o;
}

std::string open_error(const std::string& prefix) {
    try {
        IndexedDataset ds(prefix);
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST(IndexedDataset, RoundTrip) {
    for (TokenCode code : {TokenCode::U16, TokenCode::I32, TokenCode::I64}) {
        std::string prefix = write_dataset(test::temp_dir(std::to_string(int(code))), code);
        IndexedDataset ds(prefix);
        auto docs = sample_docs();
        ASSERT_EQ(ds.num_sequences(), static_cast<int64_t>(docs.size()));
        EXPECT_EQ(ds.num_documents(), static_cast<int64_t>(docs.size()));
        EXPECT_EQ(ds.token_code(), code);
        for (size_t i = 0; i < docs.size(); ++i) EXPECT_EQ(ds.sequence(i), docs[i]);
        std::vector<int32_t> part(3);
        ds.read(4, 1, 3, part.data());
        EXPECT_EQ(part, std::vector<int32_t>(docs[4].begin() + 1, docs[4].begin() + 4));
    }
}

TEST(IndexedDataset, WriterMatchesMegatronLayout) {
    std::string prefix = write_dataset(test::temp_dir("d"));
    auto idx = read_file(prefix + ".idx");
    ASSERT_GE(idx.size(), 34u);
    EXPECT_EQ(std::memcmp(idx.data(), "MMIDIDX\0\0", 9), 0);
    uint64_t version;
    std::memcpy(&version, idx.data() + 9, 8);
    EXPECT_EQ(version, 1u);
    EXPECT_EQ(idx[17], 8);  // uint16 tokens
    uint64_t seqs, docs;
    std::memcpy(&seqs, idx.data() + 18, 8);
    std::memcpy(&docs, idx.data() + 26, 8);
    EXPECT_EQ(seqs, 23u);
    EXPECT_EQ(docs, 24u);  // document index has one more entry than documents
}

TEST(IndexedDataset, CorruptFilesFailNamingFileAndField) {
    std::string dir = test::temp_dir("c");
    std::string prefix = write_dataset(dir);
    auto idx = read_file(prefix + ".idx"), bin = read_file(prefix + ".bin");
    auto expect_error = [&](const std::vector<char>& i, const std::vector<char>& b,
                            const std::string& what) {
        write_file(prefix + ".idx", i);
        write_file(prefix + ".bin", b);
        std::string msg = open_error(prefix);
        EXPECT_NE(msg.find(what), std::string::npos) << "expected \"" << what << "\" in: " << msg;
    };
    auto bad = idx;
    bad[0] = 'X';
    expect_error(bad, bin, "ds.idx: bad magic");
    bad = idx;
    bad[9] = 2;
    expect_error(bad, bin, "field 'version' is 2");
    bad = idx;
    bad[17] = 42;
    expect_error(bad, bin, "field 'dtype' has unknown code 42");
    expect_error(std::vector<char>(idx.begin(), idx.end() - 5), bin, "file truncated");
    expect_error(std::vector<char>(idx.begin(), idx.begin() + 20), bin, "truncated header");
    expect_error(idx, std::vector<char>(bin.begin(), bin.end() - 2), "ds.bin: size is");
    bad = idx;
    bad[34 + 23 * 4 + 8] ^= 0x10;  // pointers[1]
    expect_error(bad, bin, "field 'pointers[1]'");
    bad = idx;
    bad[34 + 23 * 12] = 1;  // document index[0]
    expect_error(bad, bin, "document index[0]");
    write_file(prefix + ".idx", idx);
    fs::remove(prefix + ".bin");
    EXPECT_NE(open_error(prefix).find("cannot open '" + prefix + ".bin'"), std::string::npos);
}

TEST(Preprocess, TextAndJsonl) {
    std::string dir = test::temp_dir("p");
    std::ofstream(dir + "/a.txt") << "first paragraph\nstill first\n\n\nsecond one\n";
    std::ofstream(dir + "/b.jsonl") << "{\"text\": \"hi \\u00e9\"}\n\n{\"text\": \"x\"}\n";
    auto stats = preprocess(options({dir + "/a.txt", dir + "/b.jsonl"}, dir + "/out"));
    EXPECT_EQ(stats.documents, 4);
    IndexedDataset ds(dir + "/out");
    EXPECT_EQ(ByteTokenizer::decode(ds.sequence(0)), "first paragraph\nstill first<|eod|>");
    EXPECT_EQ(ByteTokenizer::decode(ds.sequence(1)), "second one<|eod|>");
    EXPECT_EQ(ds.sequence(2).size(), 3u + 2u + 1u);  // "hi " + two UTF-8 bytes + EOD
    std::ofstream(dir + "/bad.jsonl") << "{\"text\": 1}\n";
    try {
        preprocess(options({dir + "/bad.jsonl"}, dir + "/out2"));
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("bad.jsonl:1"), std::string::npos) << e.what();
    }
}

TEST(DocumentStream, ShuffleIsDeterministicAndCoversEveryDocumentPerEpoch) {
    std::string prefix = write_dataset(test::temp_dir("s"));
    auto docs = sample_docs();
    auto order = [&](uint64_t seed) {
        DocumentStream s({prefix}, seed);
        std::vector<std::vector<int32_t>> out;
        for (size_t i = 0; i < docs.size(); ++i) out.push_back(s.next_piece(1000));
        return out;
    };
    auto a = order(1), b = order(1), c = order(2);
    EXPECT_EQ(a, b);
    EXPECT_NE(a, c);
    auto sorted_a = a, sorted_docs = docs;
    std::sort(sorted_a.begin(), sorted_a.end());
    std::sort(sorted_docs.begin(), sorted_docs.end());
    EXPECT_EQ(sorted_a, sorted_docs);  // one epoch = every document exactly once
}

TEST(DocumentStream, PositionRestoresTheExactStream) {
    std::string prefix = write_dataset(test::temp_dir("r"));
    DocumentStream s({prefix}, 3);
    for (int i = 0; i < 30; ++i) s.next_piece(7);  // mid-document cuts and an epoch wrap
    std::string saved = s.position().to_json();
    std::vector<std::vector<int32_t>> expected;
    for (int i = 0; i < 40; ++i) expected.push_back(s.next_piece(11));
    DocumentStream t({prefix}, 3);
    t.set_position(StreamPosition::from_json(saved));
    for (int i = 0; i < 40; ++i) EXPECT_EQ(t.next_piece(11), expected[i]) << i;
}

TEST(DocumentStream, BlendFollowsTheWeights) {
    std::string d1 = test::temp_dir("b1"), d2 = test::temp_dir("b2");
    std::string p1 = write_dataset(d1), p2 = write_dataset(d2);
    DocumentStream s({"0.25", p1, "0.75", p2}, 9);
    for (int i = 0; i < 400; ++i) s.next_piece(1000);
    EXPECT_EQ(s.position().taken[0], 100);
    EXPECT_EQ(s.position().taken[1], 300);
    // Not a number, zero, infinite or NaN: refused, naming the item (inf was accepted and
    // turned every weight into NaN).
    for (const char* w : {"x", "0", "inf", "nan", "1e999"}) {
        const std::string msg = test::error_of([&] { DocumentStream bad({w, p1, "1", p2}, 1); });
        EXPECT_NE(msg.find(std::string("\"") + w + "\" is not a positive finite weight"),
                  std::string::npos)
            << msg;
    }
}

// Megatron's split index: rounded cumulative shares, the rounding taken off the later
// boundaries so the last is the document count.
TEST(Split, IndexFollowsMegatronsRule) {
    EXPECT_EQ(split_index(parse_split("969,30,1"), 1000),
              (std::array<int64_t, 4>{0, 969, 999, 1000}));
    EXPECT_EQ(split_index(parse_split("969, 30, 1"), 23), (std::array<int64_t, 4>{0, 22, 23, 23}));
    EXPECT_EQ(split_index(parse_split("98,2"), 23), (std::array<int64_t, 4>{0, 23, 23, 23}));
    EXPECT_EQ(split_index(parse_split("80,20"), 23), (std::array<int64_t, 4>{0, 18, 23, 23}));
    EXPECT_EQ(split_index(parse_split("1"), 5), (std::array<int64_t, 4>{0, 5, 5, 5}));
    EXPECT_EQ(split_index(parse_split("1,1,1"), 10), (std::array<int64_t, 4>{0, 4, 7, 10}));
    for (const char* bad : {"", "a,1", "1,-2", "1,2,3,4", "0,0,0", "1,,2", "inf"})
        EXPECT_NE(test::error_of([&] { parse_split(bad); }).find("recipe key 'split'"),
                  std::string::npos)
            << bad;
    EXPECT_EQ(parse_data_part("validation"), DataPart::Valid);
    EXPECT_NE(test::error_of([&] { parse_data_part("dev"); }).find("train, valid or test"),
              std::string::npos);
}

// Each part draws only its own documents (disjoint ranges in document order, shuffled within),
// every one of them per epoch; an empty part is an error naming it.
TEST(DocumentStream, SplitPartsAreDisjointAndCovered) {
    const std::string prefix = write_dataset(test::temp_dir("split"));
    const auto docs = sample_docs();  // 23 documents
    const auto split = parse_split("70,20,10");
    const auto index = split_index(split, int64_t(docs.size()));
    for (DataPart part : {DataPart::Train, DataPart::Valid, DataPart::Test}) {
        DocumentStream s({prefix}, 4, part, split);
        const int64_t lo = index[int(part)], hi = index[int(part) + 1];
        ASSERT_EQ(s.part_documents(0), hi - lo) << data_part_name(part);
        std::vector<std::vector<int32_t>> drawn, expected(docs.begin() + lo, docs.begin() + hi);
        for (int64_t i = 0; i < hi - lo; ++i) drawn.push_back(s.next_piece(1000));
        EXPECT_EQ(s.part_documents_in_order(), expected) << data_part_name(part);
        std::sort(drawn.begin(), drawn.end());
        std::sort(expected.begin(), expected.end());
        EXPECT_EQ(drawn, expected) << data_part_name(part);
    }
    const std::string msg =
        test::error_of([&] { DocumentStream s({prefix}, 4, DataPart::Test, parse_split("98,2")); });
    EXPECT_NE(msg.find("the test part holds no document"), std::string::npos) << msg;
}
