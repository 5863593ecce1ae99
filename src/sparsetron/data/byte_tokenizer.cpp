#include "sparsetron/data/byte_tokenizer.h"

#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
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

PreprocessStats preprocess(const PreprocessOptions& o) {
    ST_CHECK(!o.inputs.empty(), "preprocess: no input files");
    ST_CHECK(o.format == "auto" || o.format == "text" || o.format == "jsonl" || o.format == "ids",
             "preprocess: --input-format is auto, text, jsonl or ids, got '", o.format, "'");
    const DocumentEncoder encode = o.encode ? o.encode : [](const std::string& t) {
        return ByteTokenizer::encode_document(t);
    };
    IndexedDatasetWriter writer(o.output_prefix,
                                o.vocab_size <= 65536 ? TokenCode::U16 : TokenCode::I32);
    PreprocessStats stats;
    // Documents in batches: each batch encoded in parallel, then written in order.
    std::vector<std::string> texts;
    std::vector<std::vector<int32_t>> ids;
    auto flush = [&] {
        std::vector<std::vector<int32_t>> encoded(texts.size());
        // Documents differ in length and script by orders of magnitude: each worker takes the
        // next unencoded one, so no worker waits on another's share.
        std::atomic<size_t> next{0};
        parallel_for(num_threads(), [&](int64_t, int64_t) {
            for (size_t i; (i = next++) < texts.size();) encoded[i] = encode(texts[i]);
        });
        for (auto* batch : {&encoded, &ids})
            for (const auto& doc : *batch) {
                if (doc.empty()) continue;
                writer.add_document(doc);
                ++stats.documents;
                stats.tokens += int64_t(doc.size());
            }
        texts.clear();
        ids.clear();
    };
    auto add_text = [&](std::string doc) {
        if (doc.empty()) return;
        texts.push_back(std::move(doc));
        if (texts.size() >= 4096) flush();
    };
    for (const auto& path : o.inputs) {
        std::ifstream in(path);
        ST_CHECK(in.good(), "preprocess: cannot read input '", path, "'");
        const std::string format = o.format != "auto" ? o.format
                                   : (ends_with(path, ".jsonl") || ends_with(path, ".json"))
                                       ? "jsonl"
                                       : "text";
        std::string line, doc;
        int64_t line_no = 0;
        while (std::getline(in, line)) {
            ++line_no;
            if (format == "jsonl") {
                if (blank(line)) continue;
                nlohmann::json j;
                try {
                    j = nlohmann::json::parse(line);
                } catch (const std::exception& e) {
                    throw Error(cat(path, ":", line_no, ": invalid JSON: ", e.what()));
                }
                ST_CHECK(j.is_object() && j.contains(o.json_key) && j[o.json_key].is_string(), path,
                         ":", line_no, ": expected an object with a string field '", o.json_key,
                         "'");
                add_text(j[o.json_key].get<std::string>());
            } else if (format == "ids") {
                std::istringstream is(line);
                std::vector<int32_t> d;
                for (std::string w; is >> w;) {
                    size_t used = 0;
                    long long v = -1;
                    try {
                        v = std::stoll(w, &used);
                    } catch (const std::exception&) {
                        used = 0;
                    }
                    ST_CHECK(used == w.size() && v >= 0 && v < o.vocab_size, path, ":", line_no,
                             ": \"", w, "\" is not a token id below the vocabulary size ",
                             o.vocab_size,
                             " (preprocess takes it from --vocab-size or --tokenizer)");
                    d.push_back(int32_t(v));
                }
                if (!d.empty()) {
                    flush();  // keep the input order
                    ids.push_back(std::move(d));
                }
            } else if (blank(line)) {
                add_text(doc);
                doc.clear();
            } else {
                doc += (doc.empty() ? "" : "\n") + line;
            }
        }
        add_text(doc);
    }
    flush();
    ST_CHECK(stats.documents > 0, "preprocess: the inputs hold no documents");
    writer.finish();
    return stats;
}

}  // namespace sparsetron
