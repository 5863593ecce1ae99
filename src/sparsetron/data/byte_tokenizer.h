// Byte-level tokenizer: token = byte value (0..255), end-of-document = 256. Needs vocab >= 257.
#pragma once

#include <cstdint>
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

// `sparsetron preprocess`: plain text (documents separated by blank lines) or JSONL (one JSON
// object per line, the document in `json_key`) into `output_prefix`.{bin,idx}. Returns the number
// of documents written.
struct PreprocessStats {
    int64_t documents = 0;
    int64_t tokens = 0;
};
PreprocessStats preprocess_text(const std::vector<std::string>& inputs,
                                const std::string& output_prefix, const std::string& json_key);

}  // namespace sparsetron
