// The environment variables Sparsetron reads: every one is registered here with what it means,
// `sparsetron info` lists them with their values, and nothing else in src/ calls getenv.
// Everything that chooses what the engine computes or which kernel runs is a recipe key or a
// shape / architecture predicate, never an environment variable.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sparsetron {

struct EnvVar {
    const char* name;
    const char* meaning;
};

// Every variable the engine reads, in the order `sparsetron info` lists them.
const std::vector<EnvVar>& env_vars();

// The value of registered variable `name`, or nothing when it is unset or empty. Reading a name
// that is not registered is a bug in Sparsetron (ST_ASSERT).
std::optional<std::string> env_value(std::string_view name);

}  // namespace sparsetron
