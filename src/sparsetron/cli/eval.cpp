// `sparsetron eval`: the mean next-token loss of a model on token documents.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
#include "sparsetron/data/document_stream.h"
#include "sparsetron/data/split.h"
#include "sparsetron/runtime/evaluate.h"
#include "sparsetron/runtime/run_setup.h"

namespace sparsetron::cli {
namespace {

int eval(const std::string& model, const std::string& tokens, const std::vector<std::string>& data,
         const std::string& split_arg, const std::string& part_arg, const JsonOutput& json) {
    ST_CHECK(tokens.empty() != data.empty(), "eval: give --tokens FILE or --data PREFIX (one)");
    std::vector<std::vector<int32_t>> docs;
    std::string what;
    // Token documents are read first (a bad file is named before the model is looked at); an
    // engine checkpoint's recipe gives the split and the MTP depths (for the MTP loss).
    if (!tokens.empty()) docs = read_token_documents(tokens);
    RunRequest request;
    request.kind = RunRequest::Eval, request.model = model;
    const ResolvedRun resolved = resolve_run(request);
    const Recipe* run = resolved.has_recipe ? &resolved.recipe : nullptr;
    if (tokens.empty()) {
        // Every document of the part, in order (one or more prefixes; blend weights are not
        // needed: each document counts once).
        // The split: --split, else the run's, else every document in the train part.
        const std::string split = !split_arg.empty() ? split_arg
                                  : run              ? run->run.split
                                                     : std::string("100,0,0");
        const DataPart part = parse_data_part(part_arg);
        // Bare prefixes get weight 1 each (weights only steer a blend's order; here every
        // document counts once); a weighted list passes as it is.
        std::vector<std::string> data_path = data;
        bool weighted = false;
        for (const std::string& d : data) {
            char* end = nullptr;
            std::strtod(d.c_str(), &end);
            weighted = weighted || (!d.empty() && end && *end == '\0');
        }
        if (!weighted && data.size() > 1) {
            data_path.clear();
            for (const std::string& d : data) data_path.insert(data_path.end(), {"1", d});
        }
        DocumentStream stream(data_path, 0, part, parse_split(split));
        docs = stream.part_documents_in_order();
        what = cat(" (the ", data_part_name(part), " part of split ", split, ")");
    }
    EvalResult r = evaluate(model, docs, run ? &run->model : nullptr);
    ST_CHECK(std::isfinite(r.lm_loss), "eval: the loss of '", model, "' is not finite (", r.lm_loss,
             "): the model's outputs overflow");
    if (json.wanted()) {
        nlohmann::ordered_json j;
        j["lm_loss"] = r.lm_loss;
        j["targets"] = r.targets;
        if (r.mtp_loss > 0) j["mtp_loss"] = r.mtp_loss;
        json.write(j.dump());
    }
    if (!json.to_stdout()) {
        std::printf("lm_loss %.6f over %lld targets in %lld documents%s (perplexity %.3f)%s\n",
                    r.lm_loss, static_cast<long long>(r.targets),
                    static_cast<long long>(r.documents), what.c_str(), std::exp(r.lm_loss),
                    r.mtp_loss > 0 ? cat(" | mtp_loss ", r.mtp_loss).c_str() : "");
    }
    return 0;
}

}  // namespace

Run add_eval(CLI::App& app) {
    struct Options {
        std::string model, tokens, split, part = "valid";
        std::vector<std::string> data;
        JsonOutput json;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand("eval", "Mean next-token loss of a model on token documents");
    c->add_option("--model,-m", o->model, "Checkpoint, save directory, or HF directory")
        ->required();
    c->add_option("--tokens,-t", o->tokens, "File with one document per line as token ids");
    c->add_option("--data,-d", o->data,
                  "Dataset prefix(es) (.bin/.idx, as data_path): every document of --part")
        ->delimiter(',');
    c->add_option("--split", o->split,
                  "train,valid,test weights over each dataset's documents (default: the "
                  "checkpoint's recipe's split)");
    c->add_option("--part", o->part, "With --data: train, valid (default) or test");
    add_json_output(c, o->json, "The losses ({\"lm_loss\": ..., \"targets\": ...})");
    return [o] { return eval(o->model, o->tokens, o->data, o->split, o->part, o->json); };
}

}  // namespace sparsetron::cli
