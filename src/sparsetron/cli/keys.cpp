// `sparsetron keys`: every recipe key with its default (the built-in tiny recipe's values).
#include <cstdio>

#include "command.h"

namespace sparsetron::cli {

Run add_keys(CLI::App& app) {
    app.add_subcommand("keys", "List every recipe key with its default value");
    return [] {
        std::printf(
            "# Recipe keys (Megatron-LM names) with their defaults (the built-in tiny recipe)\n");
        std::printf("%s", builtin_tiny_recipe().to_yaml().c_str());
        return 0;
    };
}

}  // namespace sparsetron::cli
