#include "sparsetron/io/tensorboard.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

#include "sparsetron/core/crc32c.h"
#include "sparsetron/core/error.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

void put_varint(std::string& out, uint64_t v) {
    while (v >= 0x80) {
        out.push_back(char(uint8_t(v) | 0x80));
        v >>= 7;
    }
    out.push_back(char(uint8_t(v)));
}

// A field key: field number and wire type (0 varint, 1 64-bit, 2 length-delimited, 5 32-bit).
void put_key(std::string& out, int field, int wire) {
    put_varint(out, uint64_t(field) << 3 | uint64_t(wire));
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
    put_key(out, field, 2);
    put_varint(out, bytes.size());
    out += bytes;
}

template <typename T>
void put_fixed(std::string& out, T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));  // little-endian hosts (x86-64, aarch64)
    out.append(b, sizeof(T));
}

std::string event_header(double wall_time, int64_t step) {
    std::string e;
    put_key(e, 1, 1);  // Event.wall_time (double)
    put_fixed(e, wall_time);
    put_key(e, 2, 0);  // Event.step (int64)
    put_varint(e, uint64_t(step));
    return e;
}

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t bytes) {
    const uint32_t crc = crc32c(data, bytes);
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& payload) {
    std::string r;
    const uint64_t len = payload.size();
    put_fixed(r, len);
    put_fixed(r, masked_crc32c(&len, sizeof len));
    r += payload;
    put_fixed(r, masked_crc32c(payload.data(), payload.size()));
    return r;
}

std::string scalar_event(const std::string& tag, int64_t step, float value, double wall_time) {
    std::string v;
    put_bytes(v, 1, tag);  // Summary.Value.tag
    put_key(v, 2, 5);      // Summary.Value.simple_value (float)
    put_fixed(v, value);
    std::string summary;
    put_bytes(summary, 1, v);  // Summary.value
    std::string e = event_header(wall_time, step);
    put_bytes(e, 5, summary);  // Event.summary
    return e;
}

std::string file_version_event(double wall_time) {
    std::string e = event_header(wall_time, 0);
    put_bytes(e, 3, "brain.Event:2");  // Event.file_version
    return e;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    char host[256] = "localhost";
    ::gethostname(host, sizeof host - 1);
    path_ = (fs::path(dir) /
             cat("events.out.tfevents.", int64_t(now_seconds()), ".", host, ".", ::getpid()))
                .string();
    out_.open(path_, std::ios::binary | std::ios::trunc);
    ST_CHECK(out_.good(), "tensorboard_dir: cannot write '", path_, "'");
    out_ << tfrecord(file_version_event(now_seconds()));
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
    out_ << tfrecord(scalar_event(tag, step, float(value), now_seconds()));
}

bool TensorBoardWriter::flush() {
    out_.flush();
    return out_.good();
}

}  // namespace sparsetron
