// THD packing (SPEC §9): documents packed into micro-batches of exactly `capacity` token slots with
// at most `max_documents` documents. A document that does not fit is cut; its remainder starts the
// next micro-batch as a new segment (positions restart at 0, nothing attends across the cut).
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/data/document_stream.h"

namespace sparsetron {

struct MicroBatch {
    int64_t capacity = 0;             // token slots (fixed)
    int64_t max_documents = 0;        // fixed maximum document count
    std::vector<int32_t> tokens;      // [capacity]; padding slots hold 0
    std::vector<int32_t> targets;     // [capacity]; next token within the document, -1 = no loss
    std::vector<int32_t> positions;   // [capacity]; position within the document, 0 for padding
    std::vector<int32_t> cu_seqlens;  // [max_documents + 1]; padded by repeating the last value
    int64_t num_documents = 0;
    int64_t num_tokens = 0;  // real (non-padding) tokens
    int64_t num_targets() const;

    MicroBatch(int64_t capacity, int64_t max_documents);
    // Appends one document segment; returns false if the slots or the document limit are full.
    bool add_document(const std::vector<int32_t>& doc);
    void clear();
};

// Default document limit for `capacity` slots when the recipe does not set one.
int64_t default_max_documents(int64_t capacity);

class Packer {
  public:
    Packer(DocumentStream& stream, int64_t capacity, int64_t max_documents);
    // Fills `mb` (cleared first) from the stream.
    void next(MicroBatch& mb);

  private:
    DocumentStream& stream_;
    int64_t capacity_, max_documents_;
};

}  // namespace sparsetron
