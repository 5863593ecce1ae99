#include "sparsetron/data/document_stream.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"

namespace sparsetron {

std::string StreamPosition::to_json() const {
    nlohmann::json j;
    j["epoch"] = epoch;
    j["cursor"] = cursor;
    j["taken"] = taken;
    j["pending_dataset"] = pending_dataset;
    j["pending_sequence"] = pending_sequence;
    j["pending_offset"] = pending_offset;
    return j.dump();
}

StreamPosition StreamPosition::from_json(const std::string& text) {
    StreamPosition p;
    try {
        auto j = nlohmann::json::parse(text);
        p.epoch = j.at("epoch").get<std::vector<int64_t>>();
        p.cursor = j.at("cursor").get<std::vector<int64_t>>();
        p.taken = j.at("taken").get<std::vector<int64_t>>();
        p.pending_dataset = j.at("pending_dataset").get<int64_t>();
        p.pending_sequence = j.at("pending_sequence").get<int64_t>();
        p.pending_offset = j.at("pending_offset").get<int64_t>();
    } catch (const std::exception& e) {
        throw Error(cat("data position: malformed (", e.what(), ")"));
    }
    return p;
}

DocumentStream::DocumentStream(const std::vector<std::string>& data_path, uint64_t seed,
                               DataPart part, std::array<double, 3> split)
    : seed_(seed) {
    ST_CHECK(!data_path.empty(), "data_path is empty: give a dataset prefix (without .bin/.idx)");
    std::vector<std::string> prefixes;
    if (data_path.size() == 1) {
        prefixes = data_path;
        weights_ = {1.0};
    } else {
        ST_CHECK(data_path.size() % 2 == 0,
                 "data_path: a weighted list must alternate weight and prefix, got ",
                 data_path.size(), " items");
        for (size_t i = 0; i < data_path.size(); i += 2) {
            char* end = nullptr;
            double w = std::strtod(data_path[i].c_str(), &end);
            ST_CHECK(end && *end == '\0' && w > 0 && std::isfinite(w), "data_path: \"",
                     data_path[i],
                     "\" is not a positive finite weight (expected w1 prefix1 w2 prefix2 ...)");
            weights_.push_back(w);
            prefixes.push_back(data_path[i + 1]);
        }
    }
    for (size_t d = 0; d < prefixes.size(); ++d) {
        const std::string& p = prefixes[d];
        datasets_.push_back(std::make_unique<IndexedDataset>(p));
        ST_CHECK(datasets_.back()->num_sequences() > 0, p, ".idx: the dataset has no sequences");
        const auto& ds = *datasets_.back();
        const auto index = split_index(split, ds.num_sequences());
        begin_.push_back(index[int(part)]);
        end_.push_back(index[int(part) + 1]);
        if (begin_.back() == end_.back()) weights_[d] = 0;  // this part of it is empty
        // Scanning the part's tokens once bounds the ids for the vocab check.
        for (int64_t i = begin_.back(); i < end_.back(); ++i)
            for (int32_t t : ds.sequence(i)) max_token_id_ = std::max<int64_t>(max_token_id_, t);
    }
    double total = std::accumulate(weights_.begin(), weights_.end(), 0.0);
    ST_CHECK(total > 0, "split: the ", data_part_name(part), " part holds no document of ",
             data_path.size() == 1 ? data_path[0] : cat(prefixes.size(), " datasets"),
             " (raise its weight in 'split' or add documents)");
    for (double& w : weights_) w /= total;
    size_t n = datasets_.size();
    pos_.epoch.assign(n, 0);
    pos_.cursor.assign(n, 0);
    pos_.taken.assign(n, 0);
    perm_epoch_.assign(n, -1);
    perm_.resize(n);
}

void DocumentStream::set_position(const StreamPosition& p) {
    size_t n = datasets_.size();
    ST_CHECK(p.epoch.size() == n && p.cursor.size() == n && p.taken.size() == n,
             "data position was saved for ", p.epoch.size(), " datasets; data_path now has ", n);
    for (size_t d = 0; d < n; ++d) {
        ST_CHECK(p.cursor[d] >= 0 && p.cursor[d] <= part_documents(int64_t(d)),
                 "data position: cursor ", p.cursor[d], " is outside dataset ",
                 datasets_[d]->prefix(), " (", part_documents(int64_t(d)),
                 " documents in this split part)");
        ST_CHECK(p.epoch[d] >= 0 && p.taken[d] >= 0, "data position: epoch ", p.epoch[d],
                 " and taken ", p.taken[d], " of dataset ", datasets_[d]->prefix(),
                 " must be >= 0");
    }
    ST_CHECK(p.pending_dataset >= -1, "data position: pending_dataset ", p.pending_dataset,
             " (-1: none, else a dataset's index)");
    if (p.pending_dataset >= 0) {
        ST_CHECK(p.pending_dataset < static_cast<int64_t>(n) && p.pending_sequence >= 0 &&
                     p.pending_sequence < datasets_[p.pending_dataset]->num_sequences(),
                 "data position: the pending document (dataset ", p.pending_dataset, ", sequence ",
                 p.pending_sequence, ") does not exist in the current data");
        const int64_t len = datasets_[p.pending_dataset]->sequence_length(p.pending_sequence);
        ST_CHECK(p.pending_offset >= 0 && p.pending_offset < len, "data position: pending_offset ",
                 p.pending_offset, " is outside the pending document's ", len, " tokens");
    }
    pos_ = p;
}

int64_t DocumentStream::choose_dataset() const {
    // Megatron's blending rule: the dataset furthest behind its share.
    int64_t total = std::accumulate(pos_.taken.begin(), pos_.taken.end(), int64_t{0});
    int64_t best = 0;
    double best_err = -1e300;
    for (size_t d = 0; d < weights_.size(); ++d) {
        double err =
            weights_[d] * static_cast<double>(total + 1) - static_cast<double>(pos_.taken[d]);
        if (err > best_err) best_err = err, best = static_cast<int64_t>(d);
    }
    return best;
}

int64_t DocumentStream::shuffled(int64_t d, int64_t epoch, int64_t index) {
    if (perm_epoch_[d] != epoch) {
        const int64_t n = part_documents(d);
        auto& perm = perm_[d];
        perm.resize(n);
        std::iota(perm.begin(), perm.end(), 0);
        CounterRng rng(seed_, hash_name("data-shuffle") ^ (static_cast<uint64_t>(d) << 32) ^
                                  static_cast<uint64_t>(epoch));
        for (int64_t i = n - 1; i > 0; --i) {
            auto j = static_cast<int64_t>(rng.bits(i) % static_cast<uint64_t>(i + 1));
            std::swap(perm[i], perm[j]);
        }
        perm_epoch_[d] = epoch;
    }
    return begin_[d] + perm_[d][index];
}

std::vector<std::vector<int32_t>> DocumentStream::part_documents_in_order() const {
    std::vector<std::vector<int32_t>> out;
    for (size_t d = 0; d < datasets_.size(); ++d)
        for (int64_t i = begin_[d]; i < end_[d]; ++i) out.push_back(datasets_[d]->sequence(i));
    return out;
}

std::vector<int32_t> DocumentStream::next_piece(int64_t max_tokens) {
    ST_ASSERT(max_tokens > 0, "piece size");
    if (pos_.pending_dataset < 0) {
        int64_t d = choose_dataset();
        if (pos_.cursor[d] >= part_documents(d)) {
            pos_.cursor[d] = 0;
            ++pos_.epoch[d];
        }
        int64_t seq = shuffled(d, pos_.epoch[d], pos_.cursor[d]++);
        ++pos_.taken[d];
        pos_.pending_dataset = d;
        pos_.pending_sequence = seq;
        pos_.pending_offset = 0;
    }
    const IndexedDataset& ds = *datasets_[pos_.pending_dataset];
    int64_t len = ds.sequence_length(pos_.pending_sequence);
    int64_t count = std::min(max_tokens, len - pos_.pending_offset);
    std::vector<int32_t> out(count);
    ds.read(pos_.pending_sequence, pos_.pending_offset, count, out.data());
    pos_.pending_offset += count;
    if (pos_.pending_offset >= len) pos_.pending_dataset = -1;
    return out;
}

}  // namespace sparsetron
