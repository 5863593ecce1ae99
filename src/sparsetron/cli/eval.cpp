// `sparsetron eval`: the mean next-token loss of a model on token documents.
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
#include "sparsetron/runtime/evaluate.h"

namespace sparsetron::cli {
namespace {

int eval(const std::string& model, const std::string& tokens, bool json) {
    EvalResult r = evaluate(model, read_token_documents(tokens));
    ST_CHECK(std::isfinite(r.lm_loss), "eval: the loss of '", model, "' is not finite (", r.lm_loss,
             "): the model's outputs overflow");
    if (json) {
        nlohmann::ordered_json j;
        j["lm_loss"] = r.lm_loss;
        j["targets"] = r.targets;
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("lm_loss %.6f over %lld targets in %lld documents (perplexity %.3f)\n",
                    r.lm_loss, static_cast<long long>(r.targets),
                    static_cast<long long>(r.documents), std::exp(r.lm_loss));
    }
    return 0;
}

}  // namespace

Run add_eval(CLI::App& app) {
    struct Options {
        std::string model, tokens;
        bool json = false;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("eval", "Mean next-token loss of a model on token documents");
    c->add_option("--model,-m", o->model, "Checkpoint, save directory, or HF directory")
        ->required();
    c->add_option("--tokens,-t", o->tokens, "File with one document per line as token ids")
        ->required();
    c->add_flag("--json", o->json, "Print {\"lm_loss\": ..., \"targets\": ...}");
    return [o] { return eval(o->model, o->tokens, o->json); };
}

}  // namespace sparsetron::cli
