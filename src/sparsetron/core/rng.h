// Counter-based random numbers (Philox4x32-10, the generator cuRAND also uses).
//
// Every value is a pure function of (seed, stream, index), so initialization is reproducible,
// independent of thread count and of the order in which tensors are filled, and the CUDA backend
// can produce the same numbers.
#pragma once

#include <array>
#include <cstdint>

namespace sparsetron {

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo);

class CounterRng {
  public:
    CounterRng(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}
    // Uniform in [0, 1) for element `index`.
    double uniform(uint64_t index) const;
    // Standard normal for element `index` (Box-Muller on one Philox block).
    double normal(uint64_t index) const;
    // 64 uniform bits for element `index`.
    uint64_t bits(uint64_t index) const;

  private:
    uint64_t seed_;
    uint64_t stream_;
};

// Stable 64-bit hash of a string (FNV-1a), used to derive per-tensor RNG streams from names.
uint64_t hash_name(const char* s);

}  // namespace sparsetron
