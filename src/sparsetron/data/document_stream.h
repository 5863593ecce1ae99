// A deterministic stream of documents drawn from one or more indexed datasets (a weighted blend),
// each shuffled per epoch by a counter-based RNG. Its exact position is checkpointable.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsetron/data/indexed_dataset.h"
#include "sparsetron/data/split.h"

namespace sparsetron {

struct StreamPosition {
    std::vector<int64_t> epoch;   // per dataset
    std::vector<int64_t> cursor;  // per dataset: next index into its shuffled order
    std::vector<int64_t> taken;   // per dataset: documents drawn (for blending)
    // A document partly consumed by the previous micro-batch: its remainder comes next.
    int64_t pending_dataset = -1;
    int64_t pending_sequence = 0;
    int64_t pending_offset = 0;

    std::string to_json() const;
    static StreamPosition from_json(const std::string& text);
    bool operator==(const StreamPosition&) const = default;
};

class DocumentStream {
  public:
    // `data_path`: {prefix} or {w1, prefix1, w2, prefix2, ...} (Megatron's weighted list).
    // `part` of each dataset's documents by `split` weights (data/split.h; every document by
    // default); a dataset whose part is empty leaves the blend, and no document at all is an
    // error naming the part.
    DocumentStream(const std::vector<std::string>& data_path, uint64_t seed,
                   DataPart part = DataPart::Train, std::array<double, 3> split = {1, 0, 0});
    // Documents of `part` in each dataset (0 where its share rounds to none).
    int64_t part_documents(int64_t dataset) const { return end_[dataset] - begin_[dataset]; }
    // The part's documents of every dataset, in dataset then document order (no shuffling).
    std::vector<std::vector<int32_t>> part_documents_in_order() const;

    // The next piece of at most `max_tokens` tokens of the current document (a whole document
    // when it fits; otherwise its head, and the rest comes next call).
    std::vector<int32_t> next_piece(int64_t max_tokens);

    const StreamPosition& position() const { return pos_; }
    void set_position(const StreamPosition& p);
    int64_t num_datasets() const { return static_cast<int64_t>(datasets_.size()); }
    const IndexedDataset& dataset(int64_t i) const { return *datasets_[i]; }
    int64_t max_token_id() const { return max_token_id_; }

  private:
    int64_t choose_dataset() const;
    int64_t shuffled(int64_t dataset, int64_t epoch, int64_t index);

    std::vector<std::unique_ptr<IndexedDataset>> datasets_;
    std::vector<int64_t> begin_, end_;  // per dataset: the part's documents [begin, end)
    std::vector<double> weights_;
    uint64_t seed_;
    StreamPosition pos_;
    // Cache of the current epoch's permutation per dataset.
    std::vector<int64_t> perm_epoch_;
    std::vector<std::vector<int64_t>> perm_;
    int64_t max_token_id_ = 0;
};

}  // namespace sparsetron
