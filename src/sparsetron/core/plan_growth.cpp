#include "sparsetron/core/plan_growth.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

#include "sparsetron/core/error.h"

namespace sparsetron {

PlanGrowth plan_growth(const std::vector<int64_t>& lengths,
                       const std::vector<const MemoryPlan*>& plans, int64_t vocab) {
    ST_CHECK(lengths.size() == plans.size() && lengths.size() >= 2,
             "plan growth: needs one plan per length and at least two lengths");
    for (size_t i = 1; i < lengths.size(); ++i)
        ST_CHECK(lengths[i] > lengths[i - 1] && lengths[0] > 0,
                 "plan growth: lengths must be positive and strictly ascending");
    PlanGrowth g;
    g.lengths = lengths;
    g.vocab = vocab;
    std::map<std::string, size_t> index;  // name -> position in g.buffers
    for (size_t i = 0; i < plans.size(); ++i) {
        std::array<size_t, kNumMemClasses> classes{};
        for (int c = 0; c < kNumMemClasses; ++c) classes[c] = plans[i]->class_bytes(MemClass(c));
        g.class_bytes.push_back(classes);
        for (const PlanEntry& e : plans[i]->entries()) {
            auto [it, added] = index.emplace(e.name, g.buffers.size());
            if (added)
                g.buffers.push_back(
                    BufferGrowth{e.name, e.cls, std::vector<size_t>(lengths.size(), 0), {}, 0});
            g.buffers[it->second].bytes[i] += e.bytes;
            g.buffers[it->second].shape = e.shape;
        }
    }
    for (BufferGrowth& b : g.buffers) {
        for (size_t i = 1; i < lengths.size(); ++i) {
            const double tokens = double(lengths[i]) / double(lengths[i - 1]);
            // A buffer that appears only at the longer length grows without bound.
            const double bytes = b.bytes[i - 1] ? double(b.bytes[i]) / double(b.bytes[i - 1])
                                 : b.bytes[i]   ? std::numeric_limits<double>::infinity()
                                                : 0.0;
            b.excess = std::max(b.excess, bytes / tokens);
        }
    }
    return g;
}

std::vector<const BufferGrowth*> PlanGrowth::faster_than_linear(double tolerance) const {
    std::vector<const BufferGrowth*> out;
    for (const BufferGrowth& b : buffers)
        if (b.excess > 1.0 + tolerance) out.push_back(&b);
    std::stable_sort(out.begin(), out.end(), [](const BufferGrowth* a, const BufferGrowth* b) {
        return a->bytes.back() > b->bytes.back();
    });
    return out;
}

std::vector<const BufferGrowth*> PlanGrowth::tokens_by_vocab() const {
    std::vector<const BufferGrowth*> out;
    if (vocab <= 0) return out;
    for (const BufferGrowth& b : buffers) {
        const bool vocab_dim = std::find(b.shape.begin(), b.shape.end(), vocab) != b.shape.end();
        // Growing between the two longest lengths: a chunk of rows bounded by the loss chunk
        // grows only while the micro-batch is shorter than the chunk.
        const size_t n = b.bytes.size();
        if (vocab_dim && b.bytes[n - 1] > b.bytes[n - 2]) out.push_back(&b);
    }
    return out;
}

namespace {

std::string column(const std::string& s, size_t width) {
    return s.size() >= width ? s + " " : s + std::string(width - s.size(), ' ');
}

}  // namespace

std::string PlanGrowth::format(int top) const {
    std::ostringstream os;
    os << column("tokens per micro-batch", 24);
    for (int64_t l : lengths) os << column(std::to_string(l), 14);
    os << "\n";
    std::vector<size_t> totals(lengths.size(), 0);
    for (int c = 0; c < kNumMemClasses; ++c) {
        const bool host = MemClass(c) == MemClass::HostOffload;
        if (host && std::all_of(class_bytes.begin(), class_bytes.end(),
                                [&](const auto& b) { return b[c] == 0; }))
            continue;  // no activation offload
        os << column(mem_class_name(MemClass(c)), 24);
        for (size_t i = 0; i < lengths.size(); ++i) {
            os << column(format_bytes(double(class_bytes[i][c])), 14);
            if (!host) totals[i] += class_bytes[i][c];
        }
        os << "\n";
    }
    os << column("total (device)", 24);
    for (size_t t : totals) os << column(format_bytes(double(t)), 14);
    os << "\n\n";
    const auto list = [&](const std::vector<const BufferGrowth*>& found, bool excess) {
        for (size_t k = 0; k < found.size() && int(k) < top; ++k) {
            const BufferGrowth& b = *found[k];
            os << "    " << column(b.name, 36) << column(mem_class_name(b.cls), 12);
            for (size_t v : b.bytes) os << column(format_bytes(double(v)), 14);
            if (excess) {
                char text[32];
                std::snprintf(text, sizeof text, "x%.2f", b.excess);
                os << text;
            }
            os << "\n";
        }
        if (found.size() > size_t(top)) os << "    ... " << found.size() - size_t(top) << " more\n";
    };
    const auto fast = faster_than_linear();
    if (fast.empty()) {
        os << "every buffer grows at most linearly in tokens\n";
    } else {
        os << fast.size() << " buffers grow faster than the tokens (excess: their largest growth "
           << "between consecutive lengths over the tokens')\n";
        list(fast, true);
    }
    if (vocab > 0) {
        const auto wide = tokens_by_vocab();
        if (wide.empty())
            os << "no buffer of tokens x vocabulary (" << vocab << ")\n";
        else
            os << wide.size() << " buffers of tokens x vocabulary (" << vocab << ")\n";
        list(wide, false);
    }
    return os.str();
}

}  // namespace sparsetron
