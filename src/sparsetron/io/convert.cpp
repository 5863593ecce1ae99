#include "sparsetron/io/convert.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "sparsetron/core/error.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/io/checkpoint_identity.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/io/safetensors.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

// generation_config.json from config.json's token ids (those it has).
std::string generation_config(const std::string& config_text) {
    nlohmann::ordered_json g;
    g["_from_model_config"] = true;
    const nlohmann::json c = nlohmann::json::parse(config_text);
    for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"})
        if (c.contains(k)) g[k] = c[k];
    return g.dump(2) + "\n";
}

}  // namespace

ConvertResult convert_checkpoint(const ConvertOptions& o) {
    ST_CHECK(o.dtype == DType::BF16 || o.dtype == DType::F32,
             "convert: the output dtype is bf16 or fp32");
    const fs::path in =
        is_model_dir(o.input) ? fs::path(o.input) : fs::path(resolve_checkpoint(o.input));
    ST_CHECK(fs::exists(in / "config.json"), in.string(), ": no config.json");
    // What train and eval verify before they read: the files belong together, every tensor
    // matches its CRC-32C, every value is finite (a corrupt checkpoint is not laundered into a
    // clean export with fresh checksums).
    verify_checkpoint_files(in.string());
    const fs::path out(o.output);
    ST_CHECK(
        !fs::exists(out / "model.safetensors") && !fs::exists(out / "model.safetensors.index.json"),
        "convert: '", out.string(), "' already holds weights; give an empty directory");
    ensure_writable_dir(out.string());
    const DType dtype = o.to_hf ? o.dtype : DType::F32;
    // Every tensor as fp32 (FP8 dequantized, its scales dropped), then in the output dtype.
    struct Converted {
        std::string name;
        std::vector<int64_t> shape;
        std::vector<uint8_t> bytes;
    };
    std::vector<Converted> tensors;
    std::set<std::string> files;
    for (const auto& [name, path] : tensor_files(in.string())) files.insert(path);
    for (const std::string& path : files) {
        const SafetensorsFile file(path);
        for (const auto& [name, info] : file.tensors()) {
            if (name.size() > 10 && name.compare(name.size() - 10, 10, "_scale_inv") == 0 &&
                file.contains(name.substr(0, name.size() - 10)) &&
                file.at(name.substr(0, name.size() - 10)).dtype == DType::F8E4M3)
                continue;
            const std::vector<float> v = read_checked_tensor_f32(file, name);
            Converted c{name, info.shape, std::vector<uint8_t>(v.size() * dtype_size(dtype))};
            if (dtype == DType::F32) {
                std::memcpy(c.bytes.data(), v.data(), c.bytes.size());
            } else {
                bf16* b = reinterpret_cast<bf16*>(c.bytes.data());
                for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
            }
            tensors.push_back(std::move(c));
        }
    }
    std::sort(tensors.begin(), tensors.end(),
              [](const Converted& a, const Converted& b) { return a.name < b.name; });
    // Shards: consecutive tensors until the next would pass shard_bytes.
    std::vector<std::vector<size_t>> shards(1);
    int64_t in_shard = 0;
    ConvertResult r;
    for (size_t i = 0; i < tensors.size(); ++i) {
        const int64_t n = int64_t(tensors[i].bytes.size());
        if (o.to_hf && in_shard > 0 && in_shard + n > o.shard_bytes)
            shards.emplace_back(), in_shard = 0;
        shards.back().push_back(i);
        in_shard += n;
        r.bytes += n;
    }
    r.tensors = int64_t(tensors.size());
    r.shards = int64_t(shards.size());
    const std::string config = read_text((in / "config.json").string());
    nlohmann::ordered_json weight_map;
    for (size_t s = 0; s < shards.size(); ++s) {
        char name[64];
        std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
        const std::string file = o.to_hf && shards.size() > 1 ? name : "model.safetensors";
        std::vector<SafetensorsEntry> entries;
        for (size_t i : shards[s]) {
            entries.push_back({tensors[i].name, dtype, tensors[i].shape, tensors[i].bytes.data()});
            weight_map[tensors[i].name] = file;
        }
        write_safetensors((out / file).string(), entries, {{"format", "pt"}});
    }
    if (o.to_hf && shards.size() > 1) {
        nlohmann::ordered_json index;
        index["metadata"] = {{"total_size", r.bytes}};
        index["weight_map"] = weight_map;
        write_text_durably((out / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    }
    write_text_durably((out / "config.json").string(), config);
    if (o.to_hf)
        write_text_durably((out / "generation_config.json").string(), generation_config(config));
    return r;
}

}  // namespace sparsetron
