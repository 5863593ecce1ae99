// Byte-level tokenizer: token = byte value (0..255), end-of-document = 256. Needs vocab >= 257.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sparsetron {

struct ByteTokenizer {
    static constexpr int32_t kEod = 256;
    static constexpr int64_t kMinVocab = 257;
    // Bytes of `text`, then the end-of-document token.
    static std::vector<int32_t> encode_document(const std::string& text);
    static std::string decode(const std::vector<int32_t>& tokens);
};

// `sparsetron preprocess`: documents into `output_prefix`.{bin,idx}. Inputs are plain text
// (documents separated by blank lines), JSONL (one JSON object per line, the document in
// `json_key`), or ids (one document per line of whitespace-separated token ids, already
// tokenized); `format` "auto" picks JSONL for .jsonl / .json files and text otherwise. Text is
// encoded by `encode` (the byte-level tokenizer by default, or a BPE tokenizer's), documents in
// parallel (core/thread_pool.h threads), written in input order; ids of `vocab_size` or more are
// refused, and the file stores 16-bit tokens when the vocabulary allows, else 32-bit.
struct PreprocessStats {
    int64_t documents = 0;
    int64_t tokens = 0;
};
using DocumentEncoder = std::function<std::vector<int32_t>(const std::string&)>;
struct PreprocessOptions {
    std::vector<std::string> inputs;
    std::string output_prefix;
    std::string json_key = "text";
    std::string format = "auto";  // auto | text | jsonl | ids
    DocumentEncoder encode;       // empty: ByteTokenizer::encode_document
    int64_t vocab_size = ByteTokenizer::kMinVocab;
};
PreprocessStats preprocess(const PreprocessOptions& o);

}  // namespace sparsetron
