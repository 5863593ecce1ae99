// `sparsetron eval`: mean next-token cross-entropy of a model over documents given as token ids.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"

namespace sparsetron {

struct EvalResult {
    double lm_loss = 0;   // mean CE over next-token targets within documents
    int64_t targets = 0;  // number of targets
    int64_t documents = 0;
    double mtp_loss = 0;  // with MTP: λ-scaled as training reports it (0 without)
};

// One document per line, whitespace-separated token ids; blank lines are skipped.
std::vector<std::vector<int32_t>> read_token_documents(const std::string& path);

// `model_dir`: a checkpoint directory, a save directory, or an HF directory with config.json and
// model.safetensors. Documents never attend to each other. `model`: the model as the run trained
// it (its recipe's, which says how many MTP depths and which MTP loss; config.json does not):
// then the MTP loss is reported too; without it the LM loss only.
EvalResult evaluate(const std::string& model_dir, const std::vector<std::vector<int32_t>>& docs,
                    const ModelConfig* model = nullptr);

}  // namespace sparsetron
