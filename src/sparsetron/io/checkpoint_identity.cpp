#include "sparsetron/io/checkpoint_identity.h"

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "sparsetron/core/crc32c.h"
#include "sparsetron/core/error.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/io/safetensors.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kRunMetaKey = "sparsetron.run";
constexpr const char* kIterationMetaKey = "sparsetron.iteration";

std::string crc_hex(uint32_t v) {
    char text[9];
    std::snprintf(text, sizeof text, "%08x", v);
    return text;
}

bool is_safetensors(const fs::path& p) {
    return p.extension() == ".safetensors";
}

std::string digest_of(const fs::path& p) {
    if (is_safetensors(p))
        return "crc32c-header:" + crc_hex(SafetensorsFile(p.string()).header_crc32c());
    const std::string text = read_text(p.string());
    return "crc32c:" + crc_hex(crc32c(text.data(), text.size()));
}

// What a stray file says about where it came from (its safetensors metadata), for the message.
std::string origin_of(const fs::path& p) {
    if (!is_safetensors(p)) return "";
    try {
        const SafetensorsFile f(p.string());
        const auto run = f.metadata().find(kRunMetaKey), it = f.metadata().find(kIterationMetaKey);
        if (run == f.metadata().end() || it == f.metadata().end()) return "";
        return cat(" (the file says it is iteration ", it->second, " of run ", run->second, ")");
    } catch (const std::exception&) {
        return "";
    }
}

}  // namespace

std::string new_run_id() {
    std::random_device rd;
    const uint64_t v = (uint64_t(rd()) << 32) ^ uint64_t(rd());
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
    return text;
}

std::map<std::string, std::string> checkpoint_file_metadata(const std::string& run_id,
                                                            int64_t iteration) {
    return {{kRunMetaKey, run_id}, {kIterationMetaKey, std::to_string(iteration)}};
}

std::map<std::string, std::string> checkpoint_file_digests(const std::string& dir) {
    std::map<std::string, std::string> digests;
    for (const auto& e : fs::directory_iterator(dir)) {
        const std::string name = e.path().filename().string();
        if (!e.is_regular_file() || name == kStateFile || e.path().extension() == ".tmp") continue;
        digests[name] = digest_of(e.path());
    }
    return digests;
}

void verify_checkpoint_files(const std::string& ckpt_dir) {
    const fs::path dir(ckpt_dir), state = dir / kStateFile;
    if (!fs::exists(state)) return;
    nlohmann::json js;
    try {
        js = nlohmann::json::parse(read_text(state.string()));
    } catch (const Error&) {
        throw;
    } catch (const std::exception& e) {
        throw Error(cat(state.string(), ": malformed trainer state (", e.what(), ")"));
    }
    if (!js.contains("files")) return;
    ST_CHECK(js["files"].is_object() && js.contains("run") && js.contains("iteration"),
             state.string(), ": malformed trainer state (files, run and iteration go together)");
    const std::string whose =
        cat("iteration ", js["iteration"].dump(), " of run ", js["run"].get<std::string>());
    for (const auto& [name, want] : js["files"].items()) {
        const fs::path p = dir / name;
        ST_CHECK(fs::is_regular_file(p), p.string(), " is missing: the checkpoint (", whose,
                 ") recorded it; it is incomplete and cannot be read");
        const std::string got = digest_of(p);
        ST_CHECK(got == want.get<std::string>(), p.string(),
                 " does not belong to this checkpoint (", whose, ")", origin_of(p),
                 ": its digest is ", got, " but trainer_state.json recorded ",
                 want.get<std::string>(),
                 "; it was copied in from another checkpoint or changed after the save");
    }
}

}  // namespace sparsetron
