// The byte-level BPE tokenizer read from a tokenizer.json: GPT-2's layout (ByteLevel with its
// regex) and GLM's (a Split regex with lookahead, then ByteLevel; a template adding [gMASK] <sop>;
// special tokens), merges by rank, ignore_merges, UTF-8 bytes beyond ASCII, lstrip, refusals of
// what it does not implement, and `preprocess --tokenizer`. Ids here are worked out by hand from
// the merge lists; the comparison against HuggingFace `tokenizers` on a large corpus runs on the
// GPU machine, where it is installed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/data/bpe_tokenizer.h"
#include "sparsetron/data/byte_tokenizer.h"
#include "sparsetron/data/indexed_dataset.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

// GPT-2's printable stand-in of byte b, as UTF-8 (written here independently of the tokenizer).
std::string byte_char(int b) {
    int n = 0, cp = -1;
    for (int x = 0; x < 256; ++x) {
        const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
        const int c = printable ? x : 256 + n++;
        if (x == b) cp = c;
    }
    std::string s;
    if (cp < 0x80) {
        s += char(cp);
    } else {
        s += char(0xC0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3F));
    }
    return s;
}

const char* kGlmSplit =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Byte tokens 0..255 (id = byte), then the merges' results from 256 on, in merge order.
nlohmann::json tokenizer(bool glm, bool ignore_merges = false) {
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
    const std::string G = byte_char(' ');  // "Ġ"
    const std::vector<std::pair<std::string, std::string>> merges = {
        {G, "1"},         {"h", "e"},        {"l", "l"}, {"he", "ll"},
        {"hell", "o"},    {G, "w"},          {"o", "r"}, {G + "w", "or"},
        {G + "wor", "l"}, {G + "worl", "d"}, {"1", "2"}, {"12", "3"}};
    nlohmann::json m = nlohmann::json::array();
    int id = 256;
    for (const auto& [a, b] : merges) {
        m.push_back(a + " " + b);
        vocab[a + b] = id++;  // 256 "Ġ1", 257 "he", ..., 265 "Ġworld", 266 "12", 267 "123"
    }
    vocab["xyz"] = 268;  // no merge builds it: only ignore_merges takes it whole
    nlohmann::json j;
    j["normalizer"] = nullptr;
    j["model"] = {{"type", "BPE"},
                  {"vocab", vocab},
                  {"merges", m},
                  {"unk_token", nullptr},
                  {"ignore_merges", ignore_merges}};
    j["added_tokens"] = nlohmann::json::array(
        {{{"id", 300}, {"content", "[gMASK]"}, {"special", true}},
         {{"id", 301}, {"content", "<sop>"}, {"special", true}},
         {{"id", 302}, {"content", "<|user|>"}, {"special", true}, {"lstrip", true}},
         {{"id", 70000}, {"content", "<|endoftext|>"}, {"special", true}}});
    if (glm) {
        j["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"},
               {"pattern", {{"Regex", kGlmSplit}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
        j["post_processor"] = {
            {"type", "TemplateProcessing"},
            {"single",
             {{{"SpecialToken", {{"id", "[gMASK]"}, {"type_id", 0}}}},
              {{"SpecialToken", {{"id", "<sop>"}, {"type_id", 0}}}},
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"special_tokens",
             {{"[gMASK]", {{"id", "[gMASK]"}, {"ids", {300}}, {"tokens", {"[gMASK]"}}}},
              {"<sop>", {{"id", "<sop>"}, {"ids", {301}}, {"tokens", {"<sop>"}}}}}}};
    } else {
        j["pre_tokenizer"] = {
            {"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
        j["post_processor"] = {{"type", "ByteLevel"}};
    }
    return j;
}

std::string write(const nlohmann::json& j, const std::string& dir, const std::string& name) {
    const std::string path = dir + "/" + name;
    std::ofstream(path) << j.dump();
    return path;
}

using Ids = std::vector<int32_t>;

}  // namespace

TEST(BpeTokenizer, Gpt2LayoutMergesByRank) {
    const std::string dir = test::temp_dir("gpt2");
    BpeTokenizer t(write(tokenizer(false), dir, "tokenizer.json"));
    // "hello" and " world" (GPT-2's regex): h e -> he, l l -> ll, he ll -> hell, hell o.
    EXPECT_EQ(t.encode("hello world"), (Ids{260, 265}));
    // " 12" is one piece under GPT-2's regex: "Ġ 1" outranks "1 2".
    EXPECT_EQ(t.encode(" 12"), (Ids{256, '2'}));
    // Bytes beyond ASCII: é (C3 A9), 中 (E4 B8 AD), each byte its own token here.
    EXPECT_EQ(t.encode("é中"), (Ids{0xC3, 0xA9, 0xE4, 0xB8, 0xAD}));
    EXPECT_EQ(t.encode("xyz"), (Ids{'x', 'y', 'z'}));
    EXPECT_EQ(t.vocab_size(), 70001);
    EXPECT_EQ(t.token_id("<|endoftext|>"), 70000);
}

TEST(BpeTokenizer, GlmLayoutSplitsWithLookaheadAndAddsTheTemplate) {
    const std::string dir = test::temp_dir("glm");
    BpeTokenizer t(write(tokenizer(true), dir, "tokenizer.json"));
    // [gMASK] <sop> first; <|user|> is one token wherever it is.
    EXPECT_EQ(t.encode("<|user|>hello world"), (Ids{300, 301, 302, 260, 265}));
    EXPECT_EQ(t.encode("hello world", false), (Ids{260, 265}));
    // GLM's pattern puts " " and "12" apart (no letter follows the space; \s+(?!\S) fails).
    EXPECT_EQ(t.encode(" 12", false), (Ids{' ', 266}));
    // Digits in runs of at most three: "12345" -> "123" "45".
    EXPECT_EQ(t.encode("12345", false), (Ids{267, '4', '5'}));
    // lstrip: the spaces before <|user|> belong to it.
    EXPECT_EQ(t.encode("hello  <|user|>", false), (Ids{260, 302}));
    BpeTokenizer whole(write(tokenizer(true, /*ignore_merges=*/true), dir, "im.json"));
    EXPECT_EQ(whole.encode("xyz", false), (Ids{268}));
}

TEST(BpeTokenizer, LongPiecesMergeLikeShortOnesAndEachTokenizerKeepsItsOwnCache) {
    const std::string dir = test::temp_dir("cache");
    BpeTokenizer t(write(tokenizer(false), dir, "tokenizer.json"));
    // One 150-byte piece (letters only): "hello" x 30 merges to 30 x "hello" (260), the same as
    // a short piece; the long piece bypasses the per-thread cache.
    std::string text;
    for (int i = 0; i < 30; ++i) text += "hello";
    EXPECT_EQ(t.encode(text), Ids(30, 260));
    EXPECT_EQ(t.encode("hello"), (Ids{260}));
    EXPECT_EQ(t.encode("hello"), (Ids{260}));  // now from this thread's cache
    // "hellhello": the pairs "l l" (rank 2) merge before "he ll" (3), leftmost first.
    EXPECT_EQ(t.encode("hellhello"), (Ids{259, 260}));
    // A tokenizer without merges, on the same thread: its own ids, not the cached ones.
    auto bare = tokenizer(false);
    bare["model"]["merges"] = nlohmann::json::array();
    BpeTokenizer b(write(bare, dir, "bare.json"));
    EXPECT_EQ(b.encode("hello"), (Ids{'h', 'e', 'l', 'l', 'o'}));
    EXPECT_EQ(t.encode("hello"), (Ids{260}));
}

TEST(BpeTokenizer, UnsupportedConfigurationsAreNamed) {
    const std::string dir = test::temp_dir("bad");
    auto j = tokenizer(false);
    j["normalizer"] = {{"type", "NFC"}};
    EXPECT_NE(test::error_of([&] {
                  BpeTokenizer(write(j, dir, "a.json"));
              }).find("a normalizer is not supported"),
              std::string::npos);
    j = tokenizer(false);
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
    EXPECT_NE(test::error_of([&] {
                  BpeTokenizer(write(j, dir, "b.json"));
              }).find("pre-tokenizer 'Whitespace' is not supported"),
              std::string::npos);
    j = tokenizer(false);
    j["model"]["type"] = "WordPiece";
    EXPECT_NE(test::error_of([&] {
                  BpeTokenizer(write(j, dir, "c.json"));
              }).find("model type 'WordPiece' is not supported"),
              std::string::npos);
    j = tokenizer(false);
    j["model"]["merges"].push_back("x q");  // "xq" is not in the vocabulary
    EXPECT_NE(test::error_of([&] {
                  BpeTokenizer(write(j, dir, "d.json"));
              }).find("merge token 'xq' is not in the vocabulary"),
              std::string::npos);
}

// preprocess with a tokenizer: documents encoded in parallel come out in input order, with the
// EOD token appended; ids above 65535 are stored as 32-bit tokens; pre-tokenized ids pass as they
// are.
TEST(BpeTokenizer, PreprocessWritesEveryDocumentInOrder) {
    const std::string dir = test::temp_dir("pre");
    const std::string tok = write(tokenizer(true), dir, "tokenizer.json");
    BpeTokenizer t(tok);
    std::vector<std::string> docs;
    {
        std::ofstream f(dir + "/docs.jsonl");
        for (int i = 0; i < 50; ++i) {
            docs.push_back("hello world " + std::to_string(i * 37) + (i % 3 ? " é" : " <|user|>"));
            f << nlohmann::json({{"text", docs.back()}}).dump() << "\n";
        }
    }
    auto r = test::run_cli("preprocess --tokenizer " + tok + " --append-eod '<|endoftext|>'" +
                           " --workers 2 -i " + dir + "/docs.jsonl -o " + dir + "/ds");
    ASSERT_EQ(r.code, 0) << r.output;
    IndexedDataset ds(dir + "/ds");
    ASSERT_EQ(ds.num_sequences(), 50);
    for (int i = 0; i < 50; ++i) {
        Ids want = t.encode(docs[size_t(i)]);
        want.push_back(70000);
        EXPECT_EQ(ds.sequence(i), want) << i;
    }
    {
        std::ofstream f(dir + "/ids.txt");
        f << "1 2 3 70000\n\n5 6\n";
    }
    auto ids = test::run_cli("preprocess --tokenizer " + tok + " --input-format ids -i " + dir +
                             "/ids.txt -o " + dir + "/ids");
    ASSERT_EQ(ids.code, 0) << ids.output;
    IndexedDataset di(dir + "/ids");
    ASSERT_EQ(di.num_sequences(), 2);
    EXPECT_EQ(di.sequence(0), (Ids{1, 2, 3, 70000}));
    EXPECT_EQ(di.sequence(1), (Ids{5, 6}));
    std::ofstream(dir + "/bad.txt") << "1 2 70001\n";
    auto bad = test::run_cli("preprocess --tokenizer " + tok + " --input-format ids -i " + dir +
                             "/bad.txt -o " + dir + "/bad");
    EXPECT_EQ(bad.code, 1);
    EXPECT_NE(bad.output.find("\"70001\" is not a token id below the vocabulary size 70001"),
              std::string::npos)
        << bad.output;
}
