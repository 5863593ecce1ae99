// Recipes: YAML files with Megatron argument names (SPEC §0), `--set key=value` overrides, and
// validation that names the key and the problem.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/run_config.h"

namespace sparsetron {

// One raw `key: value` from a recipe file or a --set override, before typing.
struct RawSetting {
    std::string key;
    std::string scalar;              // for scalars
    std::vector<std::string> items;  // for lists
    bool is_list = false;
    std::string origin;  // "recipes/tiny.yaml:12" or "--set"
};

// A numeric key's value (an Int key's exactly in int_value, and as a double in value).
struct NumericKeyValue {
    std::string key;
    bool is_int = false;
    int64_t int_value = 0;
    double value = 0;
};

struct Recipe {
    ModelConfig model;
    RunConfig run;
    std::string name = "builtin:tiny";  // where it came from
    std::vector<RawSetting> settings;   // what was set, in order (for the checkpoint's copy)

    // Applies one setting; unknown keys and bad values throw with the key, origin and a hint.
    void apply(const RawSetting& s);
    // Checks the combination (shapes, divisibility, supported values); call after all applies.
    void validate();
    // Stable hash of the effective settings (multi-rank runs compare it).
    std::string to_yaml() const;
    // Every Int and Float key's value, in key order.
    std::vector<NumericKeyValue> numeric_values() const;
};

// Every recipe key's name, in the order to_yaml writes them.
std::vector<std::string> recipe_key_names();

// The hint an unknown key's error gives: Megatron's name for a common HF/PyTorch name, the
// nearest key when it is a few edits away, or where the keys are listed.
std::string unknown_key_hint(const std::string& key);

// Parses "key=value" (value may be a comma-free scalar or "[a, b]").
RawSetting parse_override(const std::string& kv);

// The built-in tiny recipe (also in recipes/tiny.yaml).
Recipe builtin_tiny_recipe();

}  // namespace sparsetron
