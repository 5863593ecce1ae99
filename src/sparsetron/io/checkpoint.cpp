#include "sparsetron/io/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/core/error.h"
#include "sparsetron/io/checkpoint_identity.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/io/safetensors.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

constexpr const char* kLatest = "latest_checkpointed_iteration.txt";

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
                throw Error(
                    cat("unsupported weight dtype ", dtype_name(src.dtype), " (F32, F64 or BF16)"));
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

// Index of the first element of `t` that is not finite (or negative, for a second-moment
// estimate, which the update takes the square root of), or -1.
template <typename F>
int64_t first_bad(const F* x, int64_t n, bool non_negative) {
    for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i]) || (non_negative && x[i] < F(0))) return i;
    return -1;
}

// Loaded state must be usable: a NaN weight skips every step (and is saved again), a NaN or
// negative exp_avg_sq writes NaN into the weights at the next update.
template <typename F>
void check_values(const SafetensorsFile& file, const std::string& name, const F* x, int64_t n) {
    const bool second_moment = name.size() > 11 && name.rfind(".exp_avg_sq") == name.size() - 11;
    const int64_t bad = first_bad(x, n, second_moment);
    if (bad < 0) return;
    throw Error(cat(file.path(), ": tensor '", name, "' holds ", double(x[bad]), " at element ",
                    bad,
                    second_moment ? " (a second-moment estimate must be finite and >= 0)"
                                  : " (weights and optimizer state must be finite)",
                    ": the checkpoint cannot be trained from; resume from an earlier one"));
}

void check_values(const SafetensorsFile& file, const std::string& name, const Tensor& t) {
    if (t.dtype == DType::F32) check_values(file, name, t.ptr<float>(), t.numel());
    if (t.dtype == DType::F64) check_values(file, name, t.ptr<double>(), t.numel());
}

void load_tensors(const SafetensorsFile& file, const std::string& what,
                  const std::vector<std::pair<std::string, Tensor>>& targets) {
    for (const auto& [name, dst] : targets) {
        ST_CHECK(file.contains(name), file.path(), ": missing ", what, " tensor '", name, "'");
        const auto& info = file.at(name);
        std::vector<int64_t> want(dst.shape.begin(), dst.shape.begin() + dst.ndim);
        ST_CHECK(info.shape == want, file.path(), ": tensor '", name, "' has shape ",
                 shape_str(info.shape), " but the model config expects ", shape_str(want));
        file.verify(name);
        try {
            if (info.dtype == DType::F8E4M3) {
                const std::vector<float> v = read_tensor_f32(file, name);
                for (size_t i = 0; i < v.size(); ++i)
                    if (dst.dtype == DType::F32)
                        dst.ptr<float>()[i] = v[i];
                    else
                        dst.ptr<double>()[i] = v[i];
            } else {
                convert_into(info, dst);
            }
        } catch (const Error& e) {
            throw Error(cat(file.path(), ": tensor '", name, "': ", e.what()));
        }
        check_values(file, name, dst);
    }
}

bool has_weights(const fs::path& dir) {
    return fs::exists(dir / "model.safetensors") ||
           fs::exists(dir / "model.safetensors.index.json");
}

// Loads `targets` from <base>.safetensors in `dir`, or from the shards its
// <base>.safetensors.index.json lists (HF's sharded format); tensors not targeted are not read.
void load_from(const fs::path& dir, const std::string& base, const std::string& what,
               const std::vector<std::pair<std::string, Tensor>>& targets) {
    if (fs::exists(dir / (base + ".safetensors"))) {
        load_tensors(SafetensorsFile((dir / (base + ".safetensors")).string()), what, targets);
        return;
    }
    const std::map<std::string, std::string> files = tensor_files(dir.string(), base);
    std::map<std::string, std::vector<std::pair<std::string, Tensor>>> by_shard;
    for (const auto& [name, dst] : targets) {
        const auto it = files.find(name);
        ST_CHECK(it != files.end(), (dir / (base + ".safetensors.index.json")).string(),
                 ": weight_map has no entry for '", name, "'");
        by_shard[it->second].emplace_back(name, dst);
    }
    for (const auto& [shard, list] : by_shard) load_tensors(SafetensorsFile(shard), what, list);
}

}  // namespace

void ensure_writable_dir(const std::string& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    ST_CHECK(!ec && fs::is_directory(dir), "cannot create output directory '", dir,
             "': ", ec ? ec.message() : "not a directory");
    ST_CHECK(::access(dir.c_str(), W_OK) == 0, "output directory '", dir, "' is not writable");
}

namespace {

// "model-00002-of-00004.safetensors" (HF's shard names, 1-based).
std::string shard_file(const std::string& base, int shard, int shards) {
    std::ostringstream os;
    os << base << "-" << std::setw(5) << std::setfill('0') << shard + 1 << "-of-" << std::setw(5)
       << std::setfill('0') << shards << ".safetensors";
    return os.str();
}

// Every rank learns whether every rank succeeded; on failure all of them throw (a rank that
// threw alone would leave the others waiting in the next collective).
void agree(Comm* world, const std::string& error, const std::string& what) {
    if (!world || world->size() == 1) {
        if (!error.empty()) throw Error(error);
        return;
    }
    const std::vector<uint64_t> ok = world->allgather(error.empty() ? 1 : 0);
    if (!error.empty()) throw Error(error);
    for (size_t r = 0; r < ok.size(); ++r)
        ST_CHECK(ok[r] == 1, what, " failed on rank ", r, " (its log says why)");
}

template <typename F>
std::string capture_error(F&& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return e.what();
    }
    return {};
}

// The weights and optimizer state this rank writes: its routed experts, and with `dense` the
// other tensors it holds but pipeline copies (another stage writes the original).
void collect(const ParamStore& store, const MemoryPlan& plan, const Optimizer* optimizer,
             bool dense, std::vector<SafetensorsEntry>& weights,
             std::vector<SafetensorsEntry>& optim) {
    std::map<std::string, bool> expert;
    for (const auto& p : store.params()) {
        if (p.pipeline_copy) continue;
        expert[p.name] = p.routed_expert;
        if (!dense && !p.routed_expert) continue;
        Tensor t = plan.view(p.param_slot);
        weights.push_back({p.name, t.dtype, p.shape, t.data});
    }
    if (!optimizer) return;
    for (const auto& [name, slot] : optimizer->state_tensors()) {
        const auto it = expert.find(name.substr(0, name.rfind('.')));
        if (it == expert.end()) continue;  // a pipeline copy's state
        if (!dense && !it->second) continue;
        Tensor t = plan.view(slot);
        optim.push_back({name, t.dtype, plan.entries()[slot].shape, t.data});
    }
}

// HF's index of a sharded checkpoint: every tensor of the shard files, by the file that holds it.
void write_index(const fs::path& dir, const std::string& base, int shards) {
    nlohmann::json map = nlohmann::json::object();
    size_t total = 0;
    for (int s = 0; s < shards; ++s) {
        const std::string file = shard_file(base, s, shards);
        SafetensorsFile f((dir / file).string());
        for (const auto& [name, info] : f.tensors()) {
            ST_CHECK(!map.contains(name), "checkpoint: tensor '", name, "' is in two shards");
            map[name] = file;
            total += info.bytes;
        }
    }
    nlohmann::json js;
    js["metadata"] = {{"total_size", total}};
    js["weight_map"] = map;
    write_text_durably(dir / (base + ".safetensors.index.json"), js.dump(1) + "\n");
}

// The run id trainer_state.json in `dir` records ("" without one or when unreadable).
std::string run_of(const fs::path& dir) {
    try {
        const nlohmann::json js = nlohmann::json::parse(read_text(dir / "trainer_state.json"));
        return js.value("run", std::string());
    } catch (const std::exception&) {
        return "";
    }
}

// The run's checkpoints up to `saved`, beyond the newest `keep_last`, are deleted; nothing else
// is (Retention).
void prune(const fs::path& root, const Retention& retention, int64_t saved) {
    if (retention.keep_last <= 0 || retention.run_id.empty()) return;
    std::vector<int64_t> mine;
    for (const auto& e : fs::directory_iterator(root)) {
        const std::string name = e.path().filename().string();
        if (!e.is_directory() || name.rfind("iter_", 0) != 0 || name.size() < 12) continue;
        int64_t it = -1;
        try {
            size_t used = 0;
            it = std::stoll(name.substr(5), &used);
            if (used != name.size() - 5 || iter_name(it) != name) continue;
        } catch (const std::exception&) {
            continue;
        }
        if (it <= saved && run_of(e.path()) == retention.run_id) mine.push_back(it);
    }
    std::sort(mine.begin(), mine.end());
    for (size_t i = 0; i + size_t(retention.keep_last) < mine.size(); ++i)
        fs::remove_all(root / iter_name(mine[i]));
}

}  // namespace

std::string save_checkpoint(const std::string& save_dir, const Retention& retention,
                            const ModelConfig& m, const std::string& recipe_yaml,
                            const ParamStore& store, const MemoryPlan& plan,
                            const Optimizer* optimizer, const TrainerState& state,
                            const CheckpointShards* shards) {
    Comm* world = shards ? shards->world : nullptr;
    // The shards of one checkpoint go to one directory: every rank must name the same one.
    if (world && world->size() > 1) {
        const std::string dir = fs::absolute(save_dir).lexically_normal().string();
        const std::vector<uint64_t> dirs = world->allgather(std::hash<std::string>{}(dir));
        for (size_t r = 1; r < dirs.size(); ++r)
            ST_CHECK(dirs[r] == dirs[0], "a sharded checkpoint goes to one directory, but rank ", r,
                     " saves to another than rank 0 (this rank: ", dir,
                     "); set `save` to one path every rank sees");
    }
    const bool lead = !world || world->rank() == 0;
    const fs::path root(save_dir);
    const std::string name = iter_name(state.iteration);
    // The writers of a sharded checkpoint share one temporary directory: one name on every rank.
    const fs::path tmp = root / cat(".tmp-", name, shards ? std::string() : cat("-", ::getpid()));
    std::string error;
    if (lead)
        error = capture_error([&] {
            ensure_writable_dir(save_dir);
            fs::remove_all(tmp);
            fs::create_directories(tmp);
        });
    agree(world, error, "creating the checkpoint directory");
    auto discard = [&] {
        std::error_code ec;
        if (lead) fs::remove_all(tmp, ec);
    };
    const int shard = shards ? shards->shard : 0;
    error = capture_error([&] {
        if (shard < 0) return;
        std::vector<SafetensorsEntry> weights, optim;
        collect(store, plan, optimizer, !shards || shards->dense, weights, optim);
        const int n = shards ? shards->shards : 1;
        std::map<std::string, std::string> meta =
            checkpoint_file_metadata(state.run_id, state.iteration);
        if (optimizer)
            write_safetensors(
                (tmp / (shards ? shard_file("optimizer", shard, n) : "optimizer.safetensors"))
                    .string(),
                optim, meta);
        meta["format"] = "pt";
        write_safetensors(
            (tmp / (shards ? shard_file("model", shard, n) : "model.safetensors")).string(),
            weights, meta);
    });
    try {
        agree(world, error, "writing the checkpoint's shards");
    } catch (...) {
        discard();
        throw;
    }
    fs::path final_dir = root / name;
    if (lead)
        error = capture_error([&] {
            if (shards) {
                write_index(tmp, "model", shards->shards);
                if (optimizer) write_index(tmp, "optimizer", shards->shards);
            }
            write_text_durably(tmp / "config.json", hf_config_json(m));
            write_text_durably(tmp / "recipe.yaml", recipe_yaml);
            nlohmann::json js;
            js["iteration"] = state.iteration;
            js["consumed_tokens"] = state.consumed_tokens;
            js["skipped_steps"] = state.skipped_steps;
            js["rng"] = {{"kind", "philox4x32-10 counter-based"}, {"seed", state.seed}};
            js["data_position"] = nlohmann::json::parse(state.data_position);
            js["run"] = state.run_id;
            js["files"] = checkpoint_file_digests(tmp.string());
            write_text_durably(tmp / "trainer_state.json", js.dump(2) + "\n");
            if (fs::exists(final_dir)) {  // re-saving an iteration: move the old one aside first
                fs::path old = root / (".old-" + name + "-" + std::to_string(::getpid()));
                rename_durably(final_dir.string(), old.string());
                rename_durably(tmp.string(), final_dir.string());
                fs::remove_all(old);
            } else {
                rename_durably(tmp.string(), final_dir.string());
            }
            write_text_durably(root / kLatest, std::to_string(state.iteration) + "\n");
            prune(root, retention, state.iteration);
        });
    if (!error.empty()) discard();
    // No rank goes on (to read the checkpoint, or to save the next) before it is complete.
    agree(world, error, "completing the checkpoint");
    return final_dir.string();
}

std::string resolve_checkpoint(const std::string& dir) {
    const fs::path p(dir);
    ST_CHECK(fs::is_directory(p), "checkpoint directory '", dir, "' does not exist");
    if (has_weights(p)) return p.string();
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
        ST_CHECK(has_weights(c), (p / kLatest).string(), " names iteration ", it, " but ",
                 c.string(), " holds no model.safetensors (or its index)");
        return c.string();
    }
    throw Error(cat("'", dir,
                    "' is neither a checkpoint (no model.safetensors) nor a save "
                    "directory (no ",
                    kLatest, ")"));
}

void load_model_weights(const std::string& ckpt_dir, const ParamStore& store,
                        const MemoryPlan& plan) {
    verify_checkpoint_files(ckpt_dir);
    std::vector<std::pair<std::string, Tensor>> targets;
    for (const auto& p : store.params()) targets.emplace_back(p.name, plan.view(p.param_slot));
    load_from(fs::path(ckpt_dir), "model", "model", targets);
}

std::map<std::string, std::string> tensor_files(const std::string& dir, const std::string& base) {
    const fs::path d(dir), single = d / (base + ".safetensors");
    std::map<std::string, std::string> files;
    if (fs::exists(single)) {
        const SafetensorsFile file(single.string());
        for (const auto& [name, info] : file.tensors()) files[name] = single.string();
        return files;
    }
    const fs::path index = d / (base + ".safetensors.index.json");
    ST_CHECK(fs::exists(index), dir, ": no ", base, ".safetensors or ", base,
             ".safetensors.index.json");
    try {
        const nlohmann::json map = nlohmann::json::parse(read_text(index)).at("weight_map");
        for (const auto& [name, file] : map.items())
            files[name] = (d / file.get<std::string>()).string();
    } catch (const std::exception& e) {
        throw Error(cat(index.string(), ": malformed index (", e.what(), ")"));
    }
    return files;
}

bool is_model_dir(const std::string& dir) {
    return fs::exists(fs::path(dir) / "config.json") && has_weights(fs::path(dir));
}

std::vector<float> read_tensor_f32(const SafetensorsFile& file, const std::string& name) {
    const auto& src = file.at(name);
    size_t n = 1;
    for (int64_t d : src.shape) n *= size_t(d);
    std::vector<float> v(n);
    switch (src.dtype) {
        case DType::F32:
            std::memcpy(v.data(), src.data, n * 4);
            return v;
        case DType::F64:
            for (size_t i = 0; i < n; ++i)
                v[i] = float(reinterpret_cast<const double*>(src.data)[i]);
            return v;
        case DType::BF16:
            for (size_t i = 0; i < n; ++i)
                v[i] = bf16_to_float(reinterpret_cast<const bf16*>(src.data)[i]);
            return v;
        case DType::F8E4M3:
            break;
        default:
            throw Error(cat(file.path(), ": tensor '", name, "': unsupported weight dtype ",
                            dtype_name(src.dtype), " (F32, F64, BF16 or F8_E4M3)"));
    }
    // FP8: each 128x128 block times its scale (scale_inv: what multiplies the e4m3 values back).
    const std::string scale_name = name + "_scale_inv";
    ST_CHECK(src.shape.size() == 2, file.path(), ": FP8 tensor '", name, "' must be 2-D");
    ST_CHECK(file.contains(scale_name), file.path(), ": FP8 (F8_E4M3) tensor '", name,
             "' without its '", scale_name, "' block scales in the same file");
    const auto& s = file.at(scale_name);
    const int64_t rows = src.shape[0], cols = src.shape[1], br = (rows + 127) / 128,
                  bc = (cols + 127) / 128;
    ST_CHECK(s.shape == std::vector<int64_t>({br, bc}) &&
                 (s.dtype == DType::F32 || s.dtype == DType::BF16),
             file.path(), ": '", scale_name, "' must be F32 or BF16 [", br, ", ", bc,
             "] (one scale per 128x128 block)");
    file.verify(scale_name);
    auto scale = [&](int64_t i) {
        return s.dtype == DType::F32 ? reinterpret_cast<const float*>(s.data)[i]
                                     : bf16_to_float(reinterpret_cast<const bf16*>(s.data)[i]);
    };
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
            v[size_t(r * cols + c)] =
                cpu::e4m3_to_float(src.data[r * cols + c]) * scale((r / 128) * bc + c / 128);
    return v;
}

std::vector<float> read_checked_tensor_f32(const SafetensorsFile& file, const std::string& name) {
    file.verify(name);
    std::vector<float> v = read_tensor_f32(file, name);
    check_values(file, name, v.data(), int64_t(v.size()));
    return v;
}

std::vector<std::string> load_pretrained_weights(const std::string& dir, const ParamStore& store,
                                                 const MemoryPlan& plan) {
    const fs::path p(dir);
    verify_checkpoint_files(dir);
    const std::map<std::string, std::string> held = tensor_files(dir, "model");
    std::vector<std::pair<std::string, Tensor>> targets;
    std::vector<std::string> initialized;
    for (const auto& prm : store.params()) {
        if (held.count(prm.name)) {
            targets.emplace_back(prm.name, plan.view(prm.param_slot));
            continue;
        }
        ST_CHECK(prm.mtp, dir, ": the pretrained weights have no tensor '", prm.name,
                 "' (only the MTP layer may be missing; check that config.json matches the "
                 "recipe)");
        initialized.push_back(prm.name);
    }
    load_from(p, "model", "pretrained", targets);
    return initialized;
}

void load_optimizer_state(const std::string& ckpt_dir, const ParamStore& store,
                          const Optimizer& optimizer, const MemoryPlan& plan) {
    (void)store;
    verify_checkpoint_files(ckpt_dir);
    std::vector<std::pair<std::string, Tensor>> targets;
    for (const auto& [name, slot] : optimizer.state_tensors())
        targets.emplace_back(name, plan.view(slot));
    load_from(fs::path(ckpt_dir), "optimizer", "optimizer", targets);
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
        s.run_id = j.value("run", std::string());
    } catch (const Error&) {
        throw;
    } catch (const std::exception& e) {
        throw Error(cat(path.string(), ": malformed trainer state (", e.what(), ")"));
    }
    // The state must describe the checkpoint it sits in: a resume would otherwise pair one
    // iteration's weights with another's schedule and data position.
    ST_CHECK(s.iteration >= 0 && s.consumed_tokens >= 0 && s.skipped_steps >= 0 &&
                 s.skipped_steps <= s.iteration,
             path.string(), ": iteration ", s.iteration, ", consumed_tokens ", s.consumed_tokens,
             " and skipped_steps ", s.skipped_steps,
             " must be >= 0 (and skipped_steps <= iteration)");
    const std::string dir = fs::path(ckpt_dir).lexically_normal().filename().string();
    if (dir.rfind("iter_", 0) == 0) {
        int64_t named = -1;
        try {
            named = std::stoll(dir.substr(5));
        } catch (const std::exception&) {
        }
        ST_CHECK(named == s.iteration, path.string(), ": iteration ", s.iteration,
                 " but the checkpoint directory is ", dir,
                 ": the state belongs to another checkpoint");
    }
    return s;
}

std::string load_checkpoint_recipe(const std::string& ckpt_dir) {
    return read_text(fs::path(ckpt_dir) / "recipe.yaml");
}

}  // namespace sparsetron
