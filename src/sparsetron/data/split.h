// Megatron's `split`: each dataset's documents divided into train / valid / test ranges by
// weights ("969,30,1"), contiguous in document order, before any shuffling (so the parts never
// share a document, whatever the seed).
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace sparsetron {

enum class DataPart { Train = 0, Valid = 1, Test = 2 };
const char* data_part_name(DataPart p);
// "train", "valid" (or "validation"), "test"; anything else is an error naming the choices.
DataPart parse_data_part(const std::string& text);

// Up to three comma-separated non-negative weights ("969,30,1", "98,2", "1"; missing ones are
// 0), normalized to sum 1. Errors name the key and the value.
std::array<double, 3> parse_split(const std::string& text);

// Document ranges of a dataset of `documents` for normalized `weights`, as Megatron computes
// them: boundaries at the rounded cumulative shares, the rounding error taken off every boundary
// after the first so the last is `documents`. Part p is [index[p], index[p + 1]).
std::array<int64_t, 4> split_index(const std::array<double, 3>& weights, int64_t documents);

}  // namespace sparsetron
