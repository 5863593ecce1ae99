// HuggingFace `glm_moe_dsa` config.json <-> ModelConfig (SPEC §0 maps the names).
#pragma once

#include <string>

#include "sparsetron/config/model_config.h"

namespace sparsetron {

// Serialized config.json text for `m` (model_type glm_moe_dsa).
std::string hf_config_json(const ModelConfig& m);
// Reads a config.json; `path` is named in every error.
ModelConfig load_hf_config(const std::string& path);
ModelConfig parse_hf_config(const std::string& text, const std::string& path);

}  // namespace sparsetron
