// `sparsetron preprocess`: text, JSONL or token ids to a Megatron indexed dataset (.bin/.idx),
// with the byte-level tokenizer or a HuggingFace tokenizer.json (byte-level BPE).
#include <cstdint>
#include <cstdio>
#include <memory>

#include "command.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/data/bpe_tokenizer.h"
#include "sparsetron/data/byte_tokenizer.h"

namespace sparsetron::cli {

Run add_preprocess(CLI::App& app) {
    struct Options {
        std::vector<std::string> inputs;
        std::string output, json_key = "text", tokenizer, format = "auto", eod;
        int workers = 0;
        int64_t vocab_size = 0;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("preprocess",
                                 "Text, JSONL or token ids -> Megatron .bin/.idx (byte-level, or "
                                 "a tokenizer.json's BPE)");
    c->add_option("--input,-i", o->inputs,
                  "Input files: .txt (documents separated by blank lines), .jsonl, or ids")
        ->required();
    c->add_option("--output-prefix,-o", o->output, "Output prefix (writes PREFIX.bin, PREFIX.idx)")
        ->required();
    c->add_option("--json-key", o->json_key, "JSONL field holding the text (default: text)");
    c->add_option("--tokenizer", o->tokenizer,
                  "A HuggingFace tokenizer.json (byte-level BPE, GLM / GPT-2 style); default: "
                  "byte-level tokens with EOD 256");
    c->add_option("--input-format", o->format,
                  "auto (by extension), text, jsonl, or ids (a document per line of token ids)");
    c->add_option("--vocab-size", o->vocab_size,
                  "With --input-format ids and no --tokenizer: the vocabulary the ids index "
                  "(default: the byte-level 257; a tokenizer gives its own)")
        ->check(CLI::PositiveNumber);
    c->add_option("--append-eod", o->eod,
                  "With --tokenizer: append this token (e.g. <|endoftext|>) to every document");
    c->add_option("--workers", o->workers, "Encoding threads (default: every core)");
    return [o] {
        if (o->workers > 0) set_num_threads(o->workers);
        PreprocessOptions p{o->inputs, o->output, o->json_key,
                            o->format, {},        ByteTokenizer::kMinVocab};
        std::shared_ptr<BpeTokenizer> tok;
        std::string how = cat("byte-level, EOD = ", ByteTokenizer::kEod);
        if (!o->tokenizer.empty()) {
            tok = std::make_shared<BpeTokenizer>(o->tokenizer);
            int32_t eod = -1;
            if (!o->eod.empty()) {
                eod = tok->token_id(o->eod);
                ST_CHECK(eod >= 0, "--append-eod: '", o->eod, "' is not a token of ", o->tokenizer);
            }
            p.encode = [tok, eod](const std::string& text) {
                std::vector<int32_t> ids = tok->encode(text);
                if (eod >= 0) ids.push_back(eod);
                return ids;
            };
            p.vocab_size = tok->vocab_size();
            how = cat(o->tokenizer, ", vocabulary ", tok->vocab_size());
            ST_CHECK(o->vocab_size == 0 || o->vocab_size == tok->vocab_size(), "--vocab-size ",
                     o->vocab_size, ": ", o->tokenizer, " has ", tok->vocab_size(), " tokens");
        } else {
            ST_CHECK(o->eod.empty(), "--append-eod needs --tokenizer (byte-level appends EOD)");
            if (o->vocab_size > 0) {
                ST_CHECK(o->vocab_size <= INT32_MAX, "--vocab-size ", o->vocab_size,
                         ": token ids are 32-bit");
                p.vocab_size = o->vocab_size;
                how = cat("token ids below ", o->vocab_size);
            }
        }
        const PreprocessStats s = preprocess(p);
        std::printf("wrote %s.bin / %s.idx: %lld documents, %lld tokens (%s; %d threads)\n",
                    o->output.c_str(), o->output.c_str(), static_cast<long long>(s.documents),
                    static_cast<long long>(s.tokens), how.c_str(), num_threads());
        return 0;
    };
}

}  // namespace sparsetron::cli
