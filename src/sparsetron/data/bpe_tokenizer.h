// A byte-level BPE tokenizer read from a HuggingFace `tokenizer.json` (the GPT-2 / GLM family):
// added tokens split out first (leftmost-longest, with their lstrip / rstrip), then the
// pre-tokenizer (ByteLevel with GPT-2's split regex, or a Split regex followed by ByteLevel
// without one; the regex runs in PCRE2 with Unicode properties, since GLM's pattern uses
// lookahead), each piece's bytes mapped to GPT-2's printable characters, merged by rank
// (`ignore_merges`: a piece that is a whole vocabulary entry is taken as it is), then the
// post-processor's fixed tokens around the sequence (TemplateProcessing). A configuration outside
// this (a normalizer, other models or pre-tokenizers, subword prefixes) is refused by name.
// Thread-safe: encode() may run on many threads at once; each thread keeps a cache of the pieces
// it has encoded, as words repeat.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace sparsetron {

class BpeTokenizer {
  public:
    explicit BpeTokenizer(const std::string& tokenizer_json_path);
    ~BpeTokenizer();
    BpeTokenizer(const BpeTokenizer&) = delete;
    BpeTokenizer& operator=(const BpeTokenizer&) = delete;

    // The ids of `text` (UTF-8), with the post-processor's tokens when `add_special`.
    std::vector<int32_t> encode(const std::string& text, bool add_special = true) const;
    // The id of a vocabulary entry or added token, or -1.
    int32_t token_id(const std::string& token) const;
    // The largest id plus one (the vocabulary size a model needs).
    int64_t vocab_size() const { return vocab_size_; }

  private:
    struct Added {
        std::string content;
        int32_t id;
        bool lstrip, rstrip;
    };
    void encode_piece(const std::string& piece, std::vector<int32_t>& out) const;
    void merge_piece(const std::string& piece, std::vector<int32_t>& out) const;
    void encode_plain(const std::string& text, std::vector<int32_t>& out) const;

    struct Merge {
        int32_t rank, id;  // the merge's rank and the id of the merged token
    };
    static uint64_t pair_key(int32_t left, int32_t right) {
        return uint64_t(uint32_t(left)) << 32 | uint32_t(right);
    }

    std::unordered_map<std::string, int32_t> vocab_;
    std::unordered_map<uint64_t, Merge> merges_;  // pair_key(left id, right id) -> merge
    int32_t byte_ids_[256];                       // the id of each byte's stand-in, or -1
    uint64_t instance_;  // tells one tokenizer's per-thread piece cache from another's
    std::vector<Added> added_;
    std::vector<int32_t> prefix_, suffix_;  // the post-processor's tokens around the sequence
    std::string byte_chars_[256];           // GPT-2's printable stand-in of each byte (UTF-8)
    bool add_prefix_space_ = false, ignore_merges_ = false, split_before_byte_level_ = false;
    int32_t unk_ = -1;
    int64_t vocab_size_ = 0;
    struct Regex;
    std::unique_ptr<Regex> split_;  // the pre-tokenizer's split pattern (null: none)
};

}  // namespace sparsetron
