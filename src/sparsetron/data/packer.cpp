#include "sparsetron/data/packer.h"

#include <algorithm>

#include "sparsetron/core/error.h"

namespace sparsetron {

MicroBatch::MicroBatch(int64_t cap, int64_t max_docs) : capacity(cap), max_documents(max_docs) {
    ST_ASSERT(cap > 0 && max_docs > 0, "micro-batch shape");
    tokens.assign(cap, 0);
    targets.assign(cap, -1);
    positions.assign(cap, 0);
    cu_seqlens.assign(max_docs + 1, 0);
}

void MicroBatch::clear() {
    std::fill(tokens.begin(), tokens.end(), 0);
    std::fill(targets.begin(), targets.end(), -1);
    std::fill(positions.begin(), positions.end(), 0);
    std::fill(cu_seqlens.begin(), cu_seqlens.end(), 0);
    num_documents = 0;
    num_tokens = 0;
}

int64_t MicroBatch::num_targets() const {
    return std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; });
}

bool MicroBatch::add_document(const std::vector<int32_t>& doc) {
    int64_t n = static_cast<int64_t>(doc.size());
    if (n == 0) return true;
    if (num_documents >= max_documents || num_tokens + n > capacity) return false;
    for (int64_t i = 0; i < n; ++i) {
        int64_t slot = num_tokens + i;
        tokens[slot] = doc[i];
        positions[slot] = static_cast<int32_t>(i);
        targets[slot] = i + 1 < n ? doc[i + 1] : -1;
    }
    num_tokens += n;
    ++num_documents;
    for (int64_t d = num_documents; d <= max_documents; ++d)
        cu_seqlens[d] = static_cast<int32_t>(num_tokens);
    return true;
}

int64_t default_max_documents(int64_t capacity) {
    return std::max<int64_t>(4, capacity / 64);
}

Packer::Packer(DocumentStream& stream, int64_t capacity, int64_t max_documents)
    : stream_(stream), capacity_(capacity), max_documents_(max_documents) {}

void Packer::next(MicroBatch& mb) {
    ST_ASSERT(mb.capacity == capacity_ && mb.max_documents == max_documents_, "micro-batch shape");
    mb.clear();
    int empty_in_a_row = 0;
    while (mb.num_tokens < capacity_ && mb.num_documents < max_documents_) {
        auto piece = stream_.next_piece(capacity_ - mb.num_tokens);
        if (piece.empty()) {
            ST_CHECK(++empty_in_a_row < 1000000, "the dataset holds only empty documents");
            continue;
        }
        empty_in_a_row = 0;
        bool ok = mb.add_document(piece);
        ST_ASSERT(ok, "piece sized to fit");
    }
}

}  // namespace sparsetron
