// Megatron's indexed dataset (.bin + .idx), SPEC §9. The reader reads the index whole, checks every
// field, and reads the tokens it is asked for from the .bin; the writer produces files Megatron
// itself can read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsetron/core/dtype.h"

namespace sparsetron {

// Megatron's dtype codes: 1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16.
enum class TokenCode : uint8_t {
    U8 = 1,
    I8 = 2,
    I16 = 3,
    I32 = 4,
    I64 = 5,
    F64 = 6,
    F32 = 7,
    U16 = 8
};
size_t token_code_size(TokenCode c);

class MappedFile {
  public:
    explicit MappedFile(const std::string& path);
    ~MappedFile();
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;
    const uint8_t* data() const { return data_; }
    size_t size() const { return size_; }

  private:
    const uint8_t* data_ = nullptr;
    size_t size_ = 0;
};

// A file read by pread: when the file shrinks under the reader (a dataset replaced or cut during a
// run), a read past its end is an error naming the file, where a mapping would die of SIGBUS.
class PositionalFile {
  public:
    explicit PositionalFile(const std::string& path);
    ~PositionalFile();
    PositionalFile(const PositionalFile&) = delete;
    PositionalFile& operator=(const PositionalFile&) = delete;
    size_t size() const { return size_; }  // when opened
    void read(size_t offset, size_t bytes, void* out) const;

  private:
    std::string path_;
    int fd_ = -1;
    size_t size_ = 0;
};

class IndexedDataset {
  public:
    // Opens `prefix`.idx and `prefix`.bin; throws naming the file and field on any inconsistency.
    explicit IndexedDataset(const std::string& prefix);

    int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
    int64_t num_documents() const { return static_cast<int64_t>(doc_index_.size()) - 1; }
    int64_t num_tokens() const { return total_tokens_; }
    int64_t sequence_length(int64_t i) const { return lengths_[i]; }
    TokenCode token_code() const { return code_; }
    const std::string& prefix() const { return prefix_; }
    // Tokens of sequence i, [offset, offset+count), widened to int32 (integer codes only).
    void read(int64_t i, int64_t offset, int64_t count, int32_t* out) const;
    std::vector<int32_t> sequence(int64_t i) const;

  private:
    std::string prefix_;
    std::unique_ptr<PositionalFile> bin_;  // the .idx is read whole at construction
    TokenCode code_ = TokenCode::U16;
    std::vector<int32_t> lengths_;
    std::vector<int64_t> pointers_;
    std::vector<int64_t> doc_index_;
    int64_t total_tokens_ = 0;
};

class IndexedDatasetWriter {
  public:
    IndexedDatasetWriter(const std::string& prefix, TokenCode code);
    // Appends one sequence that is also one document.
    void add_document(const std::vector<int32_t>& tokens);
    // Writes the .idx; the .bin was streamed. Both go to temporary names renamed at the end.
    void finish();
    ~IndexedDatasetWriter();

  private:
    std::string prefix_;
    TokenCode code_;
    FILE* bin_ = nullptr;
    std::vector<int32_t> lengths_;
    std::vector<int64_t> pointers_;
    int64_t bytes_ = 0;
    bool finished_ = false;
};

}  // namespace sparsetron
