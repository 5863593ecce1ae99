// TensorBoard event files (tensorboard_dir): read back by a reader written here from the format's
// description (TFRecord framing checked with a bitwise CRC-32C of its own, the Event / Summary
// protobuf fields decoded by hand), not by the writer's code. TensorBoard's own reader checks the
// same files on the GPU machine, where it is installed (tools/check_tensorboard.py).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "sparsetron/io/tensorboard.h"
#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

uint32_t crc32c_bitwise(const uint8_t* p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; ++i) {
        c ^= p[i];
        for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
    }
    return ~c;
}

uint32_t masked(const uint8_t* p, size_t n) {
    const uint32_t c = crc32c_bitwise(p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

struct Scalar {
    std::string tag;
    int64_t step;
    float value;
};

struct EventFile {
    std::string file_version;
    std::vector<Scalar> scalars;
    std::string error;  // the first framing or decoding problem
};

uint64_t varint(const std::string& b, size_t& at) {
    uint64_t v = 0;
    for (int shift = 0; at < b.size(); shift += 7) {
        const uint8_t byte = uint8_t(b[at++]);
        v |= uint64_t(byte & 0x7f) << shift;
        if (!(byte & 0x80)) return v;
    }
    throw std::runtime_error("truncated varint");
}

// Calls fn(field, wire, value bytes or the varint) for each field of a message.
template <typename Fn>
void fields(const std::string& m, Fn fn) {
    size_t at = 0;
    while (at < m.size()) {
        const uint64_t key = varint(m, at);
        const int field = int(key >> 3), wire = int(key & 7);
        if (wire == 0) {
            fn(field, wire, std::string(), varint(m, at));
        } else if (wire == 1 || wire == 5) {
            const size_t n = wire == 1 ? 8 : 4;
            if (at + n > m.size()) throw std::runtime_error("truncated fixed field");
            fn(field, wire, m.substr(at, n), 0);
            at += n;
        } else if (wire == 2) {
            const uint64_t n = varint(m, at);
            if (at + n > m.size()) throw std::runtime_error("truncated bytes field");
            fn(field, wire, m.substr(at, n), 0);
            at += n;
        } else {
            throw std::runtime_error("unexpected wire type");
        }
    }
}

EventFile read_events(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    const std::string b((std::istreambuf_iterator<char>(in)), {});
    EventFile f;
    size_t at = 0;
    try {
        while (at < b.size()) {
            if (at + 12 > b.size()) throw std::runtime_error("truncated record header");
            uint64_t len;
            uint32_t len_crc, data_crc;
            std::memcpy(&len, b.data() + at, 8);
            std::memcpy(&len_crc, b.data() + at + 8, 4);
            if (len_crc != masked(reinterpret_cast<const uint8_t*>(b.data() + at), 8))
                throw std::runtime_error("length CRC mismatch");
            if (at + 12 + len + 4 > b.size()) throw std::runtime_error("truncated record");
            const std::string data = b.substr(at + 12, len);
            std::memcpy(&data_crc, b.data() + at + 12 + len, 4);
            if (data_crc != masked(reinterpret_cast<const uint8_t*>(data.data()), data.size()))
                throw std::runtime_error("data CRC mismatch");
            at += 12 + len + 4;
            int64_t step = 0;
            std::string summary;
            fields(data, [&](int field, int, const std::string& bytes, uint64_t v) {
                if (field == 2) step = int64_t(v);
                if (field == 3) f.file_version = bytes;
                if (field == 5) summary = bytes;
            });
            fields(summary, [&](int field, int, const std::string& value, uint64_t) {
                if (field != 1) return;
                Scalar s{"", step, 0.f};
                fields(value, [&](int vf, int wire, const std::string& bytes, uint64_t) {
                    if (vf == 1) s.tag = bytes;
                    if (vf == 2 && wire == 5) std::memcpy(&s.value, bytes.data(), 4);
                });
                f.scalars.push_back(s);
            });
        }
    } catch (const std::exception& e) {
        f.error = e.what();
    }
    return f;
}

}  // namespace

// The masked CRC of the TFRecord format on a known input ("123456789": CRC-32C 0xE3069283).
TEST(TensorBoard, MaskedCrcAndFraming) {
    const char* s = "123456789";
    EXPECT_EQ(crc32c_bitwise(reinterpret_cast<const uint8_t*>(s), 9), 0xE3069283u);
    EXPECT_EQ(masked_crc32c(s, 9), masked(reinterpret_cast<const uint8_t*>(s), 9));
    const std::string r = tfrecord("abc");
    ASSERT_EQ(r.size(), 8u + 4 + 3 + 4);
    uint64_t len;
    std::memcpy(&len, r.data(), 8);
    EXPECT_EQ(len, 3u);
    EXPECT_EQ(r.substr(12, 3), "abc");
}

// A training run with tensorboard_dir: one events file whose records all check, the version
// record first, and the losses, learning rate and validation loss at the steps metrics.jsonl
// has them (as float32); per-expert loads and throughput are there too.
TEST(TensorBoard, TrainingWritesEventsTheReaderDecodes) {
    const std::string out = test::temp_dir("tb");
    auto r = test::run_cli(
        "train -q --no-save --set train_iters=3 --set split=80,20,0 --set eval_interval=3"
        " --set eval_iters=1 --set tensorboard_dir=" +
        out + "/tb --out " + out);
    ASSERT_EQ(r.code, 0) << r.output;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(out + "/tb"))
        if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
            files.push_back(e.path());
    ASSERT_EQ(files.size(), 1u);
    const EventFile f = read_events(files[0].string());
    ASSERT_EQ(f.error, "");
    EXPECT_EQ(f.file_version, "brain.Event:2");
    std::map<std::string, std::map<int64_t, float>> by_tag;
    for (const Scalar& s : f.scalars) by_tag[s.tag][s.step] = s.value;
    std::ifstream metrics(out + "/metrics.jsonl");
    int64_t lines = 0;
    for (std::string line; std::getline(metrics, line); ++lines) {
        const auto j = nlohmann::json::parse(line);
        const int64_t step = j.at("step").get<int64_t>();
        EXPECT_EQ(by_tag["lm loss"][step], float(j.at("lm_loss").get<double>())) << step;
        EXPECT_EQ(by_tag["learning-rate"][step], float(j.at("lr").get<double>())) << step;
        EXPECT_EQ(by_tag["grad-norm"][step], float(j.at("grad_norm").get<double>())) << step;
        if (j.contains("valid_lm_loss")) {
            EXPECT_EQ(by_tag["lm loss validation"][step],
                      float(j.at("valid_lm_loss").get<double>()));
        }
    }
    EXPECT_EQ(lines, 3);
    EXPECT_EQ(by_tag["lm loss validation"].size(), 1u);
    EXPECT_EQ(by_tag["mtp loss"].size(), 3u);
    EXPECT_EQ(by_tag["throughput/tokens-per-second"].size(), 3u);
    EXPECT_GT(by_tag["memory/gib"][1], 0.f);
    EXPECT_EQ(by_tag["moe-load/layer-0/expert-0"].size(), 3u);
}
