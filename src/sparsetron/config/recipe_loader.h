// Loading recipes from YAML files. Lives in a small static library (yaml-cpp is linked
// statically into executables; Debian ships it without -fPIC, so it cannot enter the engine .so).
#pragma once

#include <string>
#include <vector>

#include "sparsetron/config/recipe.h"

namespace sparsetron {

// Reads `path` (a flat mapping of Megatron keys, optionally under a top-level `ARGS:`), applies
// `overrides` ("key=value"), and validates. An empty path means the built-in tiny recipe.
// `path` may list several files separated by commas: a recipe and its overlays, each file's keys
// replacing the ones before (e.g. "recipes/glm5.2-16gpu.yaml,recipes/overlays/h200.yaml").
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});

// Parses YAML text into raw settings (exposed for tests and for checkpoint recipe copies).
std::vector<RawSetting> parse_recipe_yaml(const std::string& text, const std::string& origin);

}  // namespace sparsetron
