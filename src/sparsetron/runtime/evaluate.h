// `sparsetron eval`: mean next-token cross-entropy of a model over documents given as token ids.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsetron {

struct EvalResult {
    double lm_loss = 0;   // mean CE over next-token targets within documents
    int64_t targets = 0;  // number of targets
    int64_t documents = 0;
};

// One document per line, whitespace-separated token ids; blank lines are skipped.
std::vector<std::vector<int32_t>> read_token_documents(const std::string& path);

// `model_dir`: a checkpoint directory, a save directory, or an HF directory with config.json and
// model.safetensors. Documents never attend to each other.
EvalResult evaluate(const std::string& model_dir, const std::vector<std::vector<int32_t>>& docs);

}  // namespace sparsetron
