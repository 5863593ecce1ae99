// What a recipe's sizes imply, checked before anything is planned: every product of keys that
// becomes a weight, an activation, a step's token count or the parameter total must fit the
// engine's bound on one buffer's elements (kMaxElements), computed with overflow checks, so that
// no later size computation (bytes, offsets, sums over layers) can wrap around.
#pragma once

#include <cstdint>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/run_config.h"

namespace sparsetron {

// 2^50 elements: 4 PiB of fp32, beyond any machine; bytes and sums of such counts stay in int64.
constexpr int64_t kMaxElements = int64_t(1) << 50;

// Throws, naming the keys whose product overflows or passes kMaxElements. Call after the keys'
// ranges are checked (config/key_ranges.h) and the layer pattern is parsed.
void check_implied_sizes(const ModelConfig& m, const RunConfig& r);

}  // namespace sparsetron
