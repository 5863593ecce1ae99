#include "sparsetron/core/rng.h"

#include <cmath>

namespace sparsetron {

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo) {
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
    constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
    uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
    uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
    uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    for (int round = 0; round < 10; ++round) {
        uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
        uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
        uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = static_cast<uint32_t>(p1);
        uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = static_cast<uint32_t>(p0);
        c0 = n0, c1 = n1, c2 = n2, c3 = n3;
        k0 += kW0, k1 += kW1;
    }
    return {c0, c1, c2, c3};
}

uint64_t CounterRng::bits(uint64_t index) const {
    auto r = philox4x32(seed_, stream_, index);
    return (static_cast<uint64_t>(r[1]) << 32) | r[0];
}

double CounterRng::uniform(uint64_t index) const {
    return static_cast<double>(bits(index) >> 11) * 0x1.0p-53;
}

double CounterRng::normal(uint64_t index) const {
    auto r = philox4x32(seed_, stream_, index);
    uint64_t a = (static_cast<uint64_t>(r[1]) << 32) | r[0];
    uint64_t b = (static_cast<uint64_t>(r[3]) << 32) | r[2];
    double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

uint64_t hash_name(const char* s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; ++s) {
        h ^= static_cast<unsigned char>(*s);
        h *= 1099511628211ull;
    }
    return h;
}

}  // namespace sparsetron
