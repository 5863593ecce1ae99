// TensorBoard event files written natively (Megatron's `tensorboard_dir`): TFRecord framing
// (length, masked CRC-32C of the length, payload, masked CRC-32C of the payload) around `Event`
// protocol buffers, the first holding the file version, the others one scalar summary each. The
// encoding is the few protobuf fields TensorBoard reads (Event.wall_time / step / file_version /
// summary, Summary.value, Value.tag / simple_value); no protobuf library is needed.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace sparsetron {

// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant.
uint32_t masked_crc32c(const void* data, size_t bytes);
// One TFRecord around `payload`.
std::string tfrecord(const std::string& payload);
// The serialized Event of one scalar (tag, value at step, wall time in seconds since the epoch).
std::string scalar_event(const std::string& tag, int64_t step, float value, double wall_time);
// The serialized Event that opens a file: file_version "brain.Event:2".
std::string file_version_event(double wall_time);

class TensorBoardWriter {
  public:
    // Creates `dir` and a new events.out.tfevents.<seconds>.<host>.<pid> file in it.
    explicit TensorBoardWriter(const std::string& dir);
    void scalar(const std::string& tag, int64_t step, double value);
    // Flushes the records so far; false when a write failed (the caller says so once).
    bool flush();
    const std::string& path() const { return path_; }

  private:
    std::string path_;
    std::ofstream out_;
};

}  // namespace sparsetron
