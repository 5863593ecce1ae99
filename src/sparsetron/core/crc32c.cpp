#include "sparsetron/core/crc32c.h"

#include <array>
#include <cstring>

namespace sparsetron {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // the Castagnoli polynomial, reflected

std::array<uint32_t, 256> make_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
        t[i] = c;
    }
    return t;
}

uint32_t crc32c_table(const uint8_t* p, size_t n, uint32_t crc) {
    static const std::array<uint32_t, 256> table = make_table();
    crc = ~crc;
    for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t* p, size_t n, uint32_t crc) {
    uint64_t c = ~crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
    }
    uint32_t c32 = uint32_t(c);
    for (; n > 0; ++p, --n) c32 = __builtin_ia32_crc32qi(c32, *p);
    return ~c32;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
    const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
    static const bool hardware = __builtin_cpu_supports("sse4.2");
    if (hardware) return crc32c_sse42(p, bytes, crc);
#endif
    return crc32c_table(p, bytes, crc);
}

}  // namespace sparsetron
