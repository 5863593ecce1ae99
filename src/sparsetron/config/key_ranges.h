// The range of every numeric recipe key: what a value must lie in before anything derived from
// it (a divisor, a buffer size, a product of sizes) is computed. NaN and infinities are outside
// every range. The bounds are far beyond any model or machine the engine targets; what a
// combination of keys implies (sizes, memory) is checked after, with overflow checks.
#pragma once

#include <vector>

#include "sparsetron/config/recipe.h"

namespace sparsetron {

struct KeyRange {
    const char* key;
    double lo, hi;
    bool lo_open = false, hi_open = false;  // (lo, ...] / [..., hi)
    const char* why = nullptr;              // why the lower bound, where a user may ask
};

// One entry per numeric key (Int or Float) of the recipe.
const std::vector<KeyRange>& key_ranges();

// Throws, naming the key, its value and the range, for the first value outside its range.
void check_key_ranges(const Recipe& recipe);

}  // namespace sparsetron
