// CRC-32C (Castagnoli): the checksum of checkpoint tensors and of TFRecord framing. Uses the
// CPU's crc32 instruction where there is one (x86-64 SSE4.2), a table otherwise; both give the
// same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparsetron {

// CRC-32C of `bytes` continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

}  // namespace sparsetron
