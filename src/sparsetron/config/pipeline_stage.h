// Which part of the model one pipeline stage holds (SPEC §10, pipeline parallelism): decoder
// layers [first_layer, end_layer); the embedding on the first stage; the final norm, the output
// head, the losses and the MTP layer on the last. Without pipeline parallelism one stage holds
// everything.
#pragma once

#include <cstdint>

namespace sparsetron {

struct PipelineStage {
    int index = 0, count = 1;
    int64_t first_layer = 0;
    int64_t end_layer = -1;  // -1: through the last layer
    bool first() const { return index == 0; }
    bool last() const { return index == count - 1; }
    bool whole() const { return count == 1; }
};

}  // namespace sparsetron
