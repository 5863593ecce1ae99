#include "sparsetron/io/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "sparsetron/core/crc32c.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/io/durable.h"

namespace sparsetron {
namespace {

const std::string kChecksumKey = "sparsetron.crc32c.";

std::string hex32(uint32_t v) {
    char text[9];
    std::snprintf(text, sizeof text, "%08x", v);
    return text;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
    // Every tensor's CRC-32C in the metadata (readers that do not know the key ignore it).
    std::vector<uint32_t> sums(entries.size());
    parallel_for(int64_t(entries.size()), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            size_t n = 1;
            for (int64_t d : entries[size_t(i)].shape) n *= static_cast<size_t>(d);
            sums[size_t(i)] =
                crc32c(entries[size_t(i)].data, n * dtype_size(entries[size_t(i)].dtype));
        }
    });
    std::map<std::string, std::string> meta = metadata;
    for (size_t i = 0; i < entries.size(); ++i)
        meta[kChecksumKey + entries[i].name] = hex32(sums[i]);
    nlohmann::ordered_json header;
    header["__metadata__"] = meta;
    size_t offset = 0;
    for (const auto& e : entries) {
        size_t n = 1;
        for (int64_t s : e.shape) n *= static_cast<size_t>(s);
        size_t bytes = n * dtype_size(e.dtype);
        header[e.name] = {{"dtype", dtype_safetensors_name(e.dtype)},
                          {"shape", e.shape},
                          {"data_offsets", {offset, offset + bytes}}};
        offset += bytes;
    }
    std::string h = header.dump();
    while (h.size() % 8 != 0) h += ' ';
    const std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    ST_CHECK(f != nullptr, "cannot write '", tmp, "': ", std::strerror(errno));
    uint64_t len = h.size();
    bool ok = std::fwrite(&len, 8, 1, f) == 1 && std::fwrite(h.data(), 1, h.size(), f) == h.size();
    for (const auto& e : entries) {
        size_t n = 1;
        for (int64_t s : e.shape) n *= static_cast<size_t>(s);
        size_t bytes = n * dtype_size(e.dtype);
        ok = ok && (bytes == 0 || std::fwrite(e.data, 1, bytes, f) == bytes);
    }
    ok = (std::fflush(f) == 0) && ok;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
        std::remove(tmp.c_str());
        throw Error(cat("writing '", tmp, "' failed (disk full?)"));
    }
    rename_durably(tmp, path);
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
    file_ = std::make_unique<MappedFile>(path);
    const uint8_t* p = file_->data();
    size_t n = file_->size();
    ST_CHECK(n >= 8, path, ": truncated (", n,
             " bytes; a safetensors file starts with an 8-byte "
             "header length)");
    uint64_t len;
    std::memcpy(&len, p, 8);
    ST_CHECK(len <= n - 8, path, ": header length ", len, " exceeds the file size ", n);
    header_crc_ = crc32c(p, 8 + len);
    nlohmann::json header;
    try {
        header = nlohmann::json::parse(p + 8, p + 8 + len);
    } catch (const std::exception& e) {
        throw Error(cat(path, ": invalid header JSON: ", e.what()));
    }
    ST_CHECK(header.is_object(), path, ": header is not a JSON object");
    const uint8_t* data = p + 8 + len;
    size_t data_bytes = n - 8 - len;
    for (auto it = header.begin(); it != header.end(); ++it) {
        if (it.key() == "__metadata__") {
            for (auto m = it->begin(); m != it->end(); ++m)
                if (m->is_string()) metadata_[m.key()] = m->get<std::string>();
            continue;
        }
        try {
            Info info;
            info.dtype = dtype_from_safetensors(it->at("dtype").get<std::string>());
            info.shape = it->at("shape").get<std::vector<int64_t>>();
            auto off = it->at("data_offsets").get<std::vector<uint64_t>>();
            ST_CHECK(off.size() == 2 && off[0] <= off[1] && off[1] <= data_bytes, "data_offsets [",
                     off.size() == 2 ? off[0] : 0, ", ", off.size() == 2 ? off[1] : 0,
                     "] outside the ", data_bytes, "-byte data section (file truncated?)");
            size_t numel = 1;
            for (int64_t s : info.shape) {
                ST_CHECK(s >= 0, "negative dimension");
                numel *= static_cast<size_t>(s);
            }
            ST_CHECK(numel * dtype_size(info.dtype) == off[1] - off[0],
                     "shape and data_offsets "
                     "disagree");
            info.data = data + off[0];
            info.bytes = off[1] - off[0];
            info.offset = off[0];
            tensors_[it.key()] = info;
        } catch (const Error& e) {
            throw Error(cat(path, ": tensor '", it.key(), "': ", e.what()));
        } catch (const std::exception& e) {
            throw Error(cat(path, ": tensor '", it.key(), "': malformed entry (", e.what(), ")"));
        }
    }
    check_layout();
}

void SafetensorsFile::check_layout() const {
    // Tensors lie one after another in the data section: overlapping ranges would let one
    // tensor's bytes be read as another's.
    std::vector<std::pair<size_t, const std::string*>> by_offset;
    for (const auto& [name, info] : tensors_) by_offset.emplace_back(info.offset, &name);
    std::sort(by_offset.begin(), by_offset.end());
    for (size_t i = 1; i < by_offset.size(); ++i) {
        const Info& prev = tensors_.at(*by_offset[i - 1].second);
        ST_CHECK(by_offset[i].first >= prev.offset + prev.bytes, path_, ": tensor '",
                 *by_offset[i].second, "' overlaps tensor '", *by_offset[i - 1].second,
                 "' (data_offsets)");
    }
}

void SafetensorsFile::verify(const std::string& name) const {
    const auto sum = metadata_.find(kChecksumKey + name);
    if (sum == metadata_.end()) return;  // written elsewhere (HF): nothing to check against
    const Info& info = at(name);
    const std::string got = hex32(crc32c(info.data, info.bytes));
    ST_CHECK(got == sum->second, path_, ": tensor '", name, "' is corrupt: its CRC-32C is ", got,
             " but the file recorded ", sum->second);
}

const SafetensorsFile::Info& SafetensorsFile::at(const std::string& name) const {
    auto it = tensors_.find(name);
    ST_CHECK(it != tensors_.end(), path_, ": no tensor named '", name, "'");
    return it->second;
}

}  // namespace sparsetron
