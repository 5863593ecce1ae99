// safetensors files: an 8-byte little-endian header length, a JSON header mapping each tensor name
// to {dtype, shape, data_offsets}, then the data. HuggingFace's format for checkpoints.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sparsetron/core/dtype.h"
#include "sparsetron/data/indexed_dataset.h"

namespace sparsetron {

struct SafetensorsEntry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;  // host memory, numel * dtype_size bytes
};

// Writes to `path`.tmp, syncs and renames, so `path` is never half-written. The metadata gains
// each tensor's CRC-32C ("sparsetron.crc32c.<name>"), which SafetensorsFile::verify checks.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

class SafetensorsFile {
  public:
    explicit SafetensorsFile(const std::string& path);
    struct Info {
        DType dtype;
        std::vector<int64_t> shape;
        const uint8_t* data;
        size_t bytes;
        size_t offset;  // within the data section
    };
    bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
    const Info& at(const std::string& name) const;
    // Throws, naming the file and the tensor, when the tensor's bytes do not match the CRC-32C
    // the file recorded for it (files without one, such as HF's, are not checked).
    void verify(const std::string& name) const;
    const std::map<std::string, Info>& tensors() const { return tensors_; }
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    const std::string& path() const { return path_; }
    // CRC-32C of the header (its length and JSON). The engine's files record every tensor's
    // CRC-32C there, so for them this one value identifies the whole file.
    uint32_t header_crc32c() const { return header_crc_; }

  private:
    void check_layout() const;  // data_offsets in order, none overlapping
    std::string path_;
    std::unique_ptr<MappedFile> file_;
    std::map<std::string, Info> tensors_;
    std::map<std::string, std::string> metadata_;
    uint32_t header_crc_ = 0;
};

}  // namespace sparsetron
