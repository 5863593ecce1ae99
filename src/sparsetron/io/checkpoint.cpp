#include "sparsetron/io/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/core/error.h"
#include "sparsetron/io/safetensors.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

constexpr const char* kLatest = "latest_checkpointed_iteration.txt";

void write_text_atomic(const fs::path& path, const std::string& text) {
    fs::path tmp = path;
    tmp += ".tmp";
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        ST_CHECK(out.good(), "cannot write '", tmp.string(), "'");
        out << text;
        out.flush();
        ST_CHECK(out.good(), "writing '", tmp.string(), "' failed (disk full?)");
    }
    fs::rename(tmp, path);
}

std::string read_text(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    ST_CHECK(in.good(), "cannot read '", path.string(), "'");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::string iter_name(int64_t it) {
    std::ostringstream os;
    os << "iter_" << std::setw(7) << std::setfill('0') << it;
    return os.str();
}

// Copies `src` (F32/F64/BF16) into `dst` (F32/F64) element by element.
void convert_into(const SafetensorsFile::Info& src, const Tensor& dst) {
    int64_t n = dst.numel();
    auto load = [&](int64_t i) -> double {
        switch (src.dtype) {
            case DType::F32:
                return reinterpret_cast<const float*>(src.data)[i];
            case DType::F64:
                return reinterpret_cast<const double*>(src.data)[i];
            case DType::BF16:
                return bf16_to_float(reinterpret_cast<const bf16*>(src.data)[i]);
            default:
                throw Error(cat("unsupported weight dtype ", dtype_name(src.dtype)));
        }
    };
    if (dst.dtype == DType::F32 && src.dtype == DType::F32) {
        std::memcpy(dst.data, src.data, n * 4);
    } else if (dst.dtype == DType::F32) {
        for (int64_t i = 0; i < n; ++i) dst.ptr<float>()[i] = static_cast<float>(load(i));
    } else {
        for (int64_t i = 0; i < n; ++i) dst.ptr<double>()[i] = load(i);
    }
}

std::string shape_str(const std::vector<int64_t>& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
}

void load_tensors(const SafetensorsFile& file, const std::string& what,
                  const std::vector<std::pair<std::string, Tensor>>& targets) {
    for (const auto& [name, dst] : targets) {
        ST_CHECK(file.contains(name), file.path(), ": missing ", what, " tensor '", name, "'");
        const auto& info = file.at(name);
        std::vector<int64_t> want(dst.shape.begin(), dst.shape.begin() + dst.ndim);
        ST_CHECK(info.shape == want, file.path(), ": tensor '", name, "' has shape ",
                 shape_str(info.shape), " but the model config expects ", shape_str(want));
        convert_into(info, dst);
    }
}

}  // namespace

void ensure_writable_dir(const std::string& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    ST_CHECK(!ec && fs::is_directory(dir), "cannot create output directory '", dir,
             "': ", ec ? ec.message() : "not a directory");
    ST_CHECK(::access(dir.c_str(), W_OK) == 0, "output directory '", dir, "' is not writable");
}

std::string save_checkpoint(const std::string& save_dir, int64_t keep_last, const ModelConfig& m,
                            const std::string& recipe_yaml, const ParamStore& store,
                            const MemoryPlan& plan, const Optimizer* optimizer,
                            const TrainerState& state) {
    ensure_writable_dir(save_dir);
    const fs::path root(save_dir);
    const std::string name = iter_name(state.iteration);
    const fs::path tmp = root / (".tmp-" + name + "-" + std::to_string(::getpid()));
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    try {
        write_text_atomic(tmp / "config.json", hf_config_json(m));
        write_text_atomic(tmp / "recipe.yaml", recipe_yaml);
        std::vector<SafetensorsEntry> weights, optim;
        for (const auto& p : store.params()) {
            Tensor t = plan.view(p.param_slot);
            weights.push_back({p.name, t.dtype, p.shape, t.data});
        }
        if (optimizer)
            for (const auto& [name, slot] : optimizer->state_tensors()) {
                Tensor t = plan.view(slot);
                const auto& shape = plan.entries()[slot].shape;
                optim.push_back({name, t.dtype, shape, t.data});
            }
        write_safetensors((tmp / "model.safetensors").string(), weights, {{"format", "pt"}});
        if (optimizer) write_safetensors((tmp / "optimizer.safetensors").string(), optim);
        nlohmann::json js;
        js["iteration"] = state.iteration;
        js["consumed_tokens"] = state.consumed_tokens;
        js["skipped_steps"] = state.skipped_steps;
        js["rng"] = {{"kind", "philox4x32-10 counter-based"}, {"seed", state.seed}};
        js["data_position"] = nlohmann::json::parse(state.data_position);
        write_text_atomic(tmp / "trainer_state.json", js.dump(2) + "\n");
    } catch (...) {
        std::error_code ec;
        fs::remove_all(tmp, ec);
        throw;
    }
    const fs::path final_dir = root / name;
    if (fs::exists(final_dir)) {  // re-saving an iteration: move the old one aside first
        fs::path old = root / (".old-" + name + "-" + std::to_string(::getpid()));
        fs::rename(final_dir, old);
        fs::rename(tmp, final_dir);
        fs::remove_all(old);
    } else {
        fs::rename(tmp, final_dir);
    }
    write_text_atomic(root / kLatest, std::to_string(state.iteration) + "\n");
    // Keep the newest `keep_last` iter_* directories.
    std::vector<fs::path> iters;
    for (const auto& e : fs::directory_iterator(root))
        if (e.is_directory() && e.path().filename().string().rfind("iter_", 0) == 0)
            iters.push_back(e.path());
    std::sort(iters.begin(), iters.end());
    for (size_t i = 0; i + keep_last < iters.size(); ++i) fs::remove_all(iters[i]);
    return final_dir.string();
}

std::string resolve_checkpoint(const std::string& dir) {
    const fs::path p(dir);
    ST_CHECK(fs::is_directory(p), "checkpoint directory '", dir, "' does not exist");
    if (fs::exists(p / "model.safetensors")) return p.string();
    if (fs::exists(p / kLatest)) {
        std::string text = read_text(p / kLatest);
        int64_t it = -1;
        try {
            it = std::stoll(text);
        } catch (const std::exception&) {
        }
        ST_CHECK(it >= 0, (p / kLatest).string(), ": expected an iteration number, got \"", text,
                 "\"");
        fs::path c = p / iter_name(it);
        ST_CHECK(fs::exists(c / "model.safetensors"), (p / kLatest).string(), " names iteration ",
                 it, " but ", (c / "model.safetensors").string(), " does not exist");
        return c.string();
    }
    throw Error(cat("'", dir,
                    "' is neither a checkpoint (no model.safetensors) nor a save "
                    "directory (no ",
                    kLatest, ")"));
}

void load_model_weights(const std::string& ckpt_dir, const ParamStore& store,
                        const MemoryPlan& plan) {
    const fs::path dir(ckpt_dir);
    if (fs::exists(dir / "model.safetensors")) {
        SafetensorsFile file((dir / "model.safetensors").string());
        std::vector<std::pair<std::string, Tensor>> targets;
        for (const auto& p : store.params()) targets.emplace_back(p.name, plan.view(p.param_slot));
        load_tensors(file, "model", targets);
        return;
    }
    // Sharded HF checkpoint: model.safetensors.index.json maps each tensor to its shard.
    const fs::path index = dir / "model.safetensors.index.json";
    ST_CHECK(fs::exists(index), ckpt_dir, ": no model.safetensors or model.safetensors.index.json");
    nlohmann::json map;
    try {
        map = nlohmann::json::parse(read_text(index)).at("weight_map");
    } catch (const std::exception& e) {
        throw Error(cat(index.string(), ": malformed index (", e.what(), ")"));
    }
    std::map<std::string, std::vector<std::pair<std::string, Tensor>>> by_shard;
    for (const auto& p : store.params()) {
        ST_CHECK(map.contains(p.name), index.string(), ": weight_map has no entry for '", p.name,
                 "'");
        by_shard[map[p.name].get<std::string>()].emplace_back(p.name, plan.view(p.param_slot));
    }
    for (const auto& [shard, targets] : by_shard)
        load_tensors(SafetensorsFile((dir / shard).string()), "model", targets);
}

bool is_model_dir(const std::string& dir) {
    return fs::exists(fs::path(dir) / "config.json") &&
           (fs::exists(fs::path(dir) / "model.safetensors") ||
            fs::exists(fs::path(dir) / "model.safetensors.index.json"));
}

void load_optimizer_state(const std::string& ckpt_dir, const ParamStore& store,
                          const Optimizer& optimizer, const MemoryPlan& plan) {
    (void)store;
    SafetensorsFile file((fs::path(ckpt_dir) / "optimizer.safetensors").string());
    std::vector<std::pair<std::string, Tensor>> targets;
    for (const auto& [name, slot] : optimizer.state_tensors())
        targets.emplace_back(name, plan.view(slot));
    load_tensors(file, "optimizer", targets);
}

TrainerState load_trainer_state(const std::string& ckpt_dir) {
    const fs::path path = fs::path(ckpt_dir) / "trainer_state.json";
    TrainerState s;
    try {
        auto j = nlohmann::json::parse(read_text(path));
        s.iteration = j.at("iteration").get<int64_t>();
        s.consumed_tokens = j.at("consumed_tokens").get<int64_t>();
        s.skipped_steps = j.value("skipped_steps", int64_t{0});
        s.seed = j.at("rng").at("seed").get<uint64_t>();
        s.data_position = j.at("data_position").dump();
    } catch (const Error&) {
        throw;
    } catch (const std::exception& e) {
        throw Error(cat(path.string(), ": malformed trainer state (", e.what(), ")"));
    }
    return s;
}

std::string load_checkpoint_recipe(const std::string& ckpt_dir) {
    return read_text(fs::path(ckpt_dir) / "recipe.yaml");
}

}  // namespace sparsetron
