#include "sparsetron/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "sparsetron/core/error.h"

namespace sparsetron {

namespace {
constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

template <typename T>
T read_at(const uint8_t* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}
}  // namespace

size_t token_code_size(TokenCode c) {
    switch (c) {
        case TokenCode::U8:
        case TokenCode::I8:
            return 1;
        case TokenCode::I16:
        case TokenCode::U16:
            return 2;
        case TokenCode::I32:
        case TokenCode::F32:
            return 4;
        case TokenCode::I64:
        case TokenCode::F64:
            return 8;
    }
    return 0;
}

MappedFile::MappedFile(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    ST_CHECK(fd >= 0, "cannot open '", path, "': ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        ::close(fd);
        throw Error(cat("cannot stat '", path, "'"));
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
        void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
        ::close(fd);
        ST_CHECK(p != MAP_FAILED, "cannot mmap '", path, "': ", std::strerror(errno));
        data_ = static_cast<const uint8_t*>(p);
    } else {
        ::close(fd);
    }
}

MappedFile::~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

PositionalFile::PositionalFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ST_CHECK(fd_ >= 0, "cannot open '", path, "': ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
        ::close(fd_);
        throw Error(cat("cannot stat '", path, "'"));
    }
    size_ = static_cast<size_t>(st.st_size);
}

PositionalFile::~PositionalFile() {
    if (fd_ >= 0) ::close(fd_);
}

void PositionalFile::read(size_t offset, size_t bytes, void* out) const {
    auto* dst = static_cast<uint8_t*>(out);
    size_t done = 0;
    while (done < bytes) {
        const ssize_t n = ::pread(fd_, dst + done, bytes - done, off_t(offset + done));
        if (n < 0 && errno == EINTR) continue;
        ST_CHECK(n >= 0, "reading '", path_, "' failed: ", std::strerror(errno));
        if (n == 0) {
            struct stat st {};
            const long long now = ::fstat(fd_, &st) == 0 ? st.st_size : -1;
            throw Error(cat("'", path_, "' is ", now, " bytes now, but the run reads bytes ",
                            offset, "..", offset + bytes, " (it was ", size_,
                            " bytes when opened): the file changed during the run; restore it and "
                            "resume from the last checkpoint"));
        }
        done += size_t(n);
    }
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
    const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
    const MappedFile idx(idx_path);  // copied into the vectors below, then unmapped
    bin_ = std::make_unique<PositionalFile>(bin_path);
    const uint8_t* p = idx.data();
    size_t n = idx.size();
    ST_CHECK(n >= kHeaderBytes, idx_path, ": truncated header (", n, " bytes, expected at least ",
             kHeaderBytes, ")");
    ST_CHECK(std::memcmp(p, kMagic, 9) == 0, idx_path,
             ": bad magic (expected MMIDIDX\\0\\0; not a Megatron indexed dataset)");
    uint64_t version = read_at<uint64_t>(p + 9);
    ST_CHECK(version == 1, idx_path, ": field 'version' is ", version, ", expected 1");
    uint8_t code = p[17];
    ST_CHECK(code >= 1 && code <= 8, idx_path, ": field 'dtype' has unknown code ", int(code));
    code_ = static_cast<TokenCode>(code);
    ST_CHECK(code_ != TokenCode::F32 && code_ != TokenCode::F64, idx_path,
             ": field 'dtype' is a float code (", int(code), "); token ids must be integers");
    uint64_t seqs = read_at<uint64_t>(p + 18);
    uint64_t docs = read_at<uint64_t>(p + 26);
    ST_CHECK(seqs < (1ull << 40) && docs < (1ull << 40), idx_path,
             ": fields 'sequence count'/'document count' are implausible (", seqs, ", ", docs, ")");
    size_t expect = kHeaderBytes + seqs * 4 + seqs * 8 + docs * 8;
    ST_CHECK(n == expect, idx_path, ": size is ", n, " bytes but the header's counts (", seqs,
             " sequences, ", docs, " document-index entries) need ", expect,
             n < expect ? " (file truncated)" : " (trailing bytes)");
    ST_CHECK(docs >= 1, idx_path, ": field 'document index' is empty (needs a leading 0)");
    const uint8_t* q = p + kHeaderBytes;
    lengths_.resize(seqs);
    pointers_.resize(seqs);
    doc_index_.resize(docs);
    std::memcpy(lengths_.data(), q, seqs * 4);
    std::memcpy(pointers_.data(), q + seqs * 4, seqs * 8);
    std::memcpy(doc_index_.data(), q + seqs * 12, docs * 8);
    size_t item = token_code_size(code_);
    int64_t expect_ptr = 0;
    for (uint64_t i = 0; i < seqs; ++i) {
        ST_CHECK(lengths_[i] >= 0, idx_path, ": field 'lengths[", i, "]' is negative");
        ST_CHECK(pointers_[i] == expect_ptr, idx_path, ": field 'pointers[", i, "]' is ",
                 pointers_[i], ", expected ", expect_ptr, " (sum of earlier lengths x ", item,
                 " bytes)");
        expect_ptr += static_cast<int64_t>(lengths_[i]) * static_cast<int64_t>(item);
        total_tokens_ += lengths_[i];
    }
    ST_CHECK(doc_index_[0] == 0, idx_path, ": field 'document index[0]' is ", doc_index_[0],
             ", expected 0");
    for (uint64_t d = 1; d < docs; ++d)
        ST_CHECK(doc_index_[d] >= doc_index_[d - 1], idx_path, ": field 'document index[", d,
                 "]' decreases");
    ST_CHECK(doc_index_.back() == static_cast<int64_t>(seqs), idx_path,
             ": field 'document index' ends at ", doc_index_.back(),
             ", expected the sequence count ", seqs);
    ST_CHECK(
        static_cast<int64_t>(bin_->size()) == expect_ptr, bin_path, ": size is ", bin_->size(),
        " bytes but ", idx_path, " describes ", expect_ptr,
        bin_->size() < static_cast<size_t>(expect_ptr) ? " (file truncated)" : " (trailing bytes)");
}

void IndexedDataset::read(int64_t i, int64_t offset, int64_t count, int32_t* out) const {
    ST_ASSERT(
        i >= 0 && i < num_sequences() && offset >= 0 && count >= 0 && offset + count <= lengths_[i],
        "read ", i, " ", offset, "+", count);
    size_t item = token_code_size(code_);
    thread_local std::vector<uint8_t> bytes;  // grows to the longest read, then reused
    bytes.resize(size_t(count) * item);
    bin_->read(size_t(pointers_[i]) + size_t(offset) * item, bytes.size(), bytes.data());
    const uint8_t* base = bytes.data();
    for (int64_t t = 0; t < count; ++t) {
        const uint8_t* e = base + t * item;
        int64_t v = 0;
        switch (code_) {
            case TokenCode::U8:
                v = *e;
                break;
            case TokenCode::I8:
                v = static_cast<int8_t>(*e);
                break;
            case TokenCode::I16:
                v = read_at<int16_t>(e);
                break;
            case TokenCode::U16:
                v = read_at<uint16_t>(e);
                break;
            case TokenCode::I32:
                v = read_at<int32_t>(e);
                break;
            case TokenCode::I64:
                v = read_at<int64_t>(e);
                break;
            default:
                ST_ASSERT(false, "float token code");
        }
        ST_CHECK(v >= 0 && v <= INT32_MAX, prefix_, ".bin: sequence ", i, " holds token id ", v,
                 " (must be a non-negative int32)");
        out[t] = static_cast<int32_t>(v);
    }
}

std::vector<int32_t> IndexedDataset::sequence(int64_t i) const {
    std::vector<int32_t> v(lengths_.at(i));
    read(i, 0, lengths_[i], v.data());
    return v;
}

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenCode code)
    : prefix_(prefix), code_(code) {
    ST_CHECK(code == TokenCode::U16 || code == TokenCode::I32 || code == TokenCode::U8 ||
                 code == TokenCode::I64,
             "indexed dataset writer: unsupported token code ", int(code));
    std::string tmp = prefix + ".bin.tmp";
    bin_ = std::fopen(tmp.c_str(), "wb");
    ST_CHECK(bin_ != nullptr, "cannot write '", tmp, "': ", std::strerror(errno));
}

void IndexedDatasetWriter::add_document(const std::vector<int32_t>& tokens) {
    ST_ASSERT(!finished_, "add after finish");
    size_t item = token_code_size(code_);
    std::vector<uint8_t> buf(tokens.size() * item);
    int64_t limit = code_ == TokenCode::U8 ? 255 : code_ == TokenCode::U16 ? 65535 : INT32_MAX;
    for (size_t t = 0; t < tokens.size(); ++t) {
        ST_CHECK(tokens[t] >= 0 && tokens[t] <= limit, "token id ", tokens[t],
                 " does not fit the dataset's token type");
        int64_t v = tokens[t];
        std::memcpy(buf.data() + t * item, &v, item);  // little-endian truncation
    }
    ST_CHECK(std::fwrite(buf.data(), 1, buf.size(), bin_) == buf.size(), "write to ", prefix_,
             ".bin.tmp failed");
    lengths_.push_back(static_cast<int32_t>(tokens.size()));
    pointers_.push_back(bytes_);
    bytes_ += static_cast<int64_t>(buf.size());
}

void IndexedDatasetWriter::finish() {
    ST_ASSERT(!finished_, "finish twice");
    finished_ = true;
    ST_CHECK(std::fclose(bin_) == 0, "closing ", prefix_, ".bin.tmp failed");
    bin_ = nullptr;
    std::string idx_tmp = prefix_ + ".idx.tmp";
    FILE* f = std::fopen(idx_tmp.c_str(), "wb");
    ST_CHECK(f != nullptr, "cannot write '", idx_tmp, "'");
    uint64_t version = 1, seqs = lengths_.size(), docs = lengths_.size() + 1;
    uint8_t code = static_cast<uint8_t>(code_);
    std::vector<int64_t> doc_index(docs);
    for (uint64_t d = 0; d < docs; ++d) doc_index[d] = static_cast<int64_t>(d);
    bool ok = std::fwrite(kMagic, 1, 9, f) == 9 && std::fwrite(&version, 8, 1, f) == 1 &&
              std::fwrite(&code, 1, 1, f) == 1 && std::fwrite(&seqs, 8, 1, f) == 1 &&
              std::fwrite(&docs, 8, 1, f) == 1 &&
              std::fwrite(lengths_.data(), 4, seqs, f) == seqs &&
              std::fwrite(pointers_.data(), 8, seqs, f) == seqs &&
              std::fwrite(doc_index.data(), 8, docs, f) == docs;
    ok = (std::fclose(f) == 0) && ok;
    ST_CHECK(ok, "writing '", idx_tmp, "' failed");
    std::filesystem::rename(prefix_ + ".bin.tmp", prefix_ + ".bin");
    std::filesystem::rename(idx_tmp, prefix_ + ".idx");
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
    if (bin_) std::fclose(bin_);
    if (!finished_) std::remove((prefix_ + ".bin.tmp").c_str());
}

}  // namespace sparsetron
