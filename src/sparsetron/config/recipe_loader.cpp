#include "sparsetron/config/recipe_loader.h"

#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "sparsetron/core/error.h"

namespace sparsetron {

std::vector<RawSetting> parse_recipe_yaml(const std::string& text, const std::string& origin) {
    YAML::Node root;
    try {
        root = YAML::Load(text);
    } catch (const YAML::Exception& e) {
        throw Error(cat(origin, ":", e.mark.line + 1, ": invalid YAML: ", e.msg));
    }
    if (root.IsNull()) return {};
    ST_CHECK(root.IsMap(), origin, ": a recipe must be a mapping of key: value");
    // The seed's recipes keep their Megatron arguments under `ARGS:`; its keys apply like top-level
    // ones (top-level keys after the block add to them).
    std::vector<std::pair<YAML::Node, YAML::Node>> items;
    for (const auto& kv : root) {
        if (kv.first.as<std::string>() == "ARGS" && kv.second.IsMap()) {
            for (const auto& inner : kv.second) items.emplace_back(inner.first, inner.second);
        } else {
            items.emplace_back(kv.first, kv.second);
        }
    }
    std::vector<RawSetting> out;
    std::map<std::string, std::string> seen;  // key -> where it was set in this file
    for (const auto& kv : items) {
        RawSetting s;
        s.key = kv.first.as<std::string>();
        s.origin = cat(origin, ":", kv.first.Mark().line + 1);
        // One value per key and file (YAML's own rule; a second one silently won before). An
        // overlay file or --set is the way to replace a value.
        const auto [at, added] = seen.emplace(s.key, s.origin);
        ST_CHECK(added, s.origin, ": recipe key '", s.key, "' is already set at ", at->second,
                 " (one value per key in a file; override it with an overlay or --set)");
        const YAML::Node& v = kv.second;
        if (v.IsSequence()) {
            s.is_list = true;
            for (const auto& item : v) {
                ST_CHECK(item.IsScalar(), s.origin, ": ", s.key, ": list items must be scalars");
                s.items.push_back(item.as<std::string>());
            }
        } else if (v.IsScalar()) {
            s.scalar = v.as<std::string>();
        } else if (v.IsNull()) {
            s.scalar = "";
        } else {
            throw Error(cat(s.origin, ": ", s.key, ": nested mappings are not recipe values"));
        }
        out.push_back(std::move(s));
    }
    return out;
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
    // No file: the built-in tiny demo; files start from the defaults (Megatron's for its keys).
    Recipe recipe = path.empty() ? builtin_tiny_recipe() : Recipe{};
    // "base.yaml,overlay.yaml,...": each file's keys over the ones before (validation runs once,
    // on the result, so an overlay may complete what its base leaves inconsistent).
    size_t begin = 0;
    while (begin < path.size()) {
        size_t end = path.find(',', begin);
        if (end == std::string::npos) end = path.size();
        const std::string file = path.substr(begin, end - begin);
        begin = end + 1;
        if (file.empty()) continue;
        std::error_code ec;
        ST_CHECK(!std::filesystem::is_directory(file, ec), "recipe file '", file,
                 "' is a directory: give a recipe's .yaml file (base.yaml,overlay.yaml for "
                 "several)");
        std::ifstream in(file);
        ST_CHECK(in.good(), "cannot read recipe file '", file, "'");
        std::stringstream ss;
        ss << in.rdbuf();
        ST_CHECK(!in.bad(), "reading recipe file '", file, "' failed");
        const std::vector<RawSetting> settings = parse_recipe_yaml(ss.str(), file);
        // An empty file would train the built-in defaults without a word.
        ST_CHECK(!settings.empty(), "recipe file '", file,
                 "' sets no key (it is empty or all comments)");
        for (const auto& s : settings) recipe.apply(s);
        recipe.name = path;
    }
    for (const auto& o : overrides) recipe.apply(parse_override(o));
    recipe.validate();
    return recipe;
}

}  // namespace sparsetron
