// `sparsetron preprocess`: text or JSONL to a Megatron indexed dataset (.bin/.idx).
#include <cstdio>
#include <memory>

#include "command.h"
#include "sparsetron/data/byte_tokenizer.h"
#include "sparsetron/runtime/trainer.h"

namespace sparsetron::cli {
namespace {

int preprocess(const std::vector<std::string>& inputs, const std::string& output,
               const std::string& json_key) {
    PreprocessStats s = preprocess_text(inputs, output, json_key);
    std::printf("wrote %s.bin / %s.idx: %lld documents, %lld tokens (byte-level, EOD = %d)\n",
                output.c_str(), output.c_str(), static_cast<long long>(s.documents),
                static_cast<long long>(s.tokens), ByteTokenizer::kEod);
    return 0;
}

}  // namespace

Run add_preprocess(CLI::App& app) {
    struct Options {
        std::vector<std::string> inputs;
        std::string output, json_key = "text";
    };
    auto o = std::make_shared<Options>();
    auto* c =
        app.add_subcommand("preprocess", "Text or JSONL -> Megatron .bin/.idx (byte-level tokens)");
    c->add_option("--input,-i", o->inputs,
                  "Input files: .txt (documents separated by blank lines) or .jsonl")
        ->required();
    c->add_option("--output-prefix,-o", o->output, "Output prefix (writes PREFIX.bin, PREFIX.idx)")
        ->required();
    c->add_option("--json-key", o->json_key, "JSONL field holding the text (default: text)");
    return [o] { return preprocess(o->inputs, o->output, o->json_key); };
}

}  // namespace sparsetron::cli
