#include "sparsetron/data/byte_tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/core/error.h"
#include "sparsetron/data/indexed_dataset.h"

namespace sparsetron {

std::vector<int32_t> ByteTokenizer::encode_document(const std::string& text) {
    std::vector<int32_t> out;
    out.reserve(text.size() + 1);
    for (unsigned char c : text) out.push_back(c);
    out.push_back(kEod);
    return out;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& tokens) {
    std::string s;
    for (int32_t t : tokens) s += t == kEod ? std::string("<|eod|>") : std::string(1, char(t));
    return s;
}

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() &&
           s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool blank(const std::string& line) {
    return line.find_first_not_of(" \t\r") == std::string::npos;
}
}  // namespace

PreprocessStats preprocess_text(const std::vector<std::string>& inputs,
                                const std::string& output_prefix, const std::string& json_key) {
    ST_CHECK(!inputs.empty(), "preprocess: no input files");
    IndexedDatasetWriter writer(output_prefix, TokenCode::U16);
    PreprocessStats stats;
    auto emit = [&](const std::string& doc) {
        if (doc.empty()) return;
        auto tokens = ByteTokenizer::encode_document(doc);
        writer.add_document(tokens);
        ++stats.documents;
        stats.tokens += static_cast<int64_t>(tokens.size());
    };
    for (const auto& path : inputs) {
        std::ifstream in(path);
        ST_CHECK(in.good(), "preprocess: cannot read input '", path, "'");
        std::string line, doc;
        int64_t line_no = 0;
        bool jsonl = ends_with(path, ".jsonl") || ends_with(path, ".json");
        while (std::getline(in, line)) {
            ++line_no;
            if (jsonl) {
                if (blank(line)) continue;
                nlohmann::json j;
                try {
                    j = nlohmann::json::parse(line);
                } catch (const std::exception& e) {
                    throw Error(cat(path, ":", line_no, ": invalid JSON: ", e.what()));
                }
                ST_CHECK(j.is_object() && j.contains(json_key) && j[json_key].is_string(), path,
                         ":", line_no, ": expected an object with a string field '", json_key, "'");
                emit(j[json_key].get<std::string>());
            } else if (blank(line)) {
                emit(doc);
                doc.clear();
            } else {
                doc += (doc.empty() ? "" : "\n") + line;
            }
        }
        emit(doc);
    }
    ST_CHECK(stats.documents > 0, "preprocess: the inputs hold no documents");
    writer.finish();
    return stats;
}

}  // namespace sparsetron
