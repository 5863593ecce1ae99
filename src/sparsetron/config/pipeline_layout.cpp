#include "sparsetron/config/pipeline_layout.h"

#include <algorithm>
#include <cctype>

#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

// A recursive-descent reader of the layout grammar: sequence := item*, item := atom ('*' N)?,
// atom := symbol | '|' | '(' sequence ')'. The text it expands to keeps `|` as stage ends.
class LayoutReader {
  public:
    explicit LayoutReader(const std::string& s) : s_(s) {}
    std::string read_all() {
        std::string out = sequence();
        ST_CHECK(pos_ == s_.size(), where(), "a ')' without its '('");
        return out;
    }

  private:
    std::string sequence() {
        std::string out;
        for (skip(); pos_ < s_.size() && s_[pos_] != ')'; skip()) out += item();
        return out;
    }
    std::string item() {
        std::string atom;
        const char c = s_[pos_];
        if (c == '(') {
            ++pos_;
            atom = sequence();
            ST_CHECK(pos_ < s_.size() && s_[pos_] == ')', where(), "a '(' without its ')'");
            ++pos_;
        } else if (c == 'E' || c == 't' || c == 'm' || c == 'L' || c == '|') {
            atom = std::string(1, c);
            ++pos_;
        } else {
            ST_CHECK(c != '*', where(), "'*' repeats the symbol or group before it; there is none");
            ST_CHECK(false, where(), "'", std::string(1, c),
                     "' is not a layout symbol (E embedding, t decoder layer, m MTP layer, L "
                     "loss, | stage end, ( ) groups, *N repeats)");
        }
        skip();
        if (pos_ < s_.size() && s_[pos_] == '*') {
            ++pos_;
            skip();
            const size_t start = pos_;
            while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
            ST_CHECK(pos_ > start, where(), "'*' needs a count");
            const long n = std::stol(s_.substr(start, pos_ - start));
            std::string rep;
            for (long i = 0; i < n; ++i) rep += atom;
            return rep;
        }
        return atom;
    }
    void skip() {
        while (pos_ < s_.size() &&
               (s_[pos_] == ',' || std::isspace(static_cast<unsigned char>(s_[pos_]))))
            ++pos_;
    }
    std::string where() const {
        return cat("pipeline_model_parallel_layout \"", s_, "\", at character ", pos_ + 1, ": ");
    }
    const std::string& s_;
    size_t pos_ = 0;
};

}  // namespace

std::vector<std::string> parse_pipeline_layout(const std::string& layout) {
    const std::string flat = LayoutReader(layout).read_all();
    std::vector<std::string> stages(1);
    for (char c : flat) {
        if (c == '|')
            stages.emplace_back();
        else
            stages.back() += c;
    }
    return stages;
}

std::vector<int64_t> pipeline_layout_counts(const std::string& layout, int64_t num_layers,
                                            int64_t mtp_num_layers, int64_t planned) {
    const std::vector<std::string> stages = parse_pipeline_layout(layout);
    const std::string key = cat("pipeline_model_parallel_layout \"", layout, "\": ");
    const int64_t n = int64_t(stages.size());
    ST_CHECK(n == planned, key, n, " stages where ", planned,
             " are planned (pipeline_model_parallel_size x virtual stages per rank)");
    const auto count = [&](char c) {
        int64_t k = 0;
        for (const std::string& s : stages) k += std::count(s.begin(), s.end(), c);
        return k;
    };
    ST_CHECK(count('E') == 1 && stages.front().rfind('E', 0) == 0, key,
             "the embedding (E) must appear once, first in the first stage");
    ST_CHECK(count('L') == 1 && !stages.back().empty() && stages.back().back() == 'L', key,
             "the loss (L) must appear once, last in the last stage");
    ST_CHECK(count('t') == num_layers, key, count('t'), " decoder layers (t), num_layers is ",
             num_layers);
    ST_CHECK(count('m') == mtp_num_layers, key, count('m'), " MTP layers (m), mtp_num_layers is ",
             mtp_num_layers);
    const std::string& last = stages.back();
    ST_CHECK(std::count(last.begin(), last.end(), 'm') == mtp_num_layers, key,
             "the MTP layers (m) must be in the last stage: the engine runs them beside the "
             "output head");
    std::vector<int64_t> counts;
    for (size_t i = 0; i < stages.size(); ++i) {
        const int64_t t = std::count(stages[i].begin(), stages[i].end(), 't');
        ST_CHECK(t > 0, key, "stage ", i,
                 " holds no decoder layer (t): the engine's stages each "
                 "run at least one");
        counts.push_back(t);
    }
    // Within the last stage the engine runs the decoder layers, then the MTP layers, then the
    // loss: a t after an m would change the model.
    ST_CHECK(
        last.find('m') == std::string::npos || last.find('t', last.find('m')) == std::string::npos,
        key,
        "a decoder layer (t) after an MTP layer (m): the MTP layers follow the last "
        "decoder layer");
    return counts;
}

}  // namespace sparsetron
