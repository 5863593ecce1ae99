// Megatron's `pipeline_model_parallel_layout`: the pipeline split as a string of stages. Symbols
// E (embedding), t (decoder layer), m (MTP layer), L (loss / output head); `|` ends a stage;
// `X*N` repeats a symbol and `(...)*N` a group (which may hold `|`); commas and spaces are
// cosmetic; empty stages are legal in the grammar. Megatron lists PP x VPP stages (all PP stages of
// virtual stage 0, then of virtual stage 1, ...), as the engine does (config/pipeline_split.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsetron {

// The expanded stages, each its symbols in order ("Ettt", "tt", "tmL"). Throws naming the
// position on a syntax error (an unknown symbol, a `*` without a count or a thing to repeat,
// unbalanced parentheses).
std::vector<std::string> parse_pipeline_layout(const std::string& layout);

// The decoder layers of each stage of `layout`, checked against the model and the pipeline:
// `stages` stages (pipeline ranks x virtual stages per rank), E the first symbol of
// the first stage and L the last of the last, num_layers t's, mtp_num_layers m's, all in the last
// stage (where the engine runs the MTP layer beside the head), at least one t per stage.
std::vector<int64_t> pipeline_layout_counts(const std::string& layout, int64_t num_layers,
                                            int64_t mtp_num_layers, int64_t stages);

}  // namespace sparsetron
