#include "sparsetron/data/split.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "sparsetron/core/error.h"

namespace sparsetron {

const char* data_part_name(DataPart p) {
    switch (p) {
        case DataPart::Train:
            return "train";
        case DataPart::Valid:
            return "valid";
        case DataPart::Test:
            return "test";
    }
    return "?";
}

DataPart parse_data_part(const std::string& text) {
    if (text == "train") return DataPart::Train;
    if (text == "valid" || text == "validation") return DataPart::Valid;
    if (text == "test") return DataPart::Test;
    throw Error(cat("data part '", text, "': expected train, valid or test"));
}

std::array<double, 3> parse_split(const std::string& text) {
    std::vector<double> w;
    std::stringstream in(text);
    for (std::string item; std::getline(in, item, ',');) {
        const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
        const std::string v = b == std::string::npos ? "" : item.substr(b, e - b + 1);
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        ST_CHECK(!v.empty() && end && *end == '\0' && std::isfinite(x) && x >= 0,
                 "recipe key 'split': '", text,
                 "' is not up to three non-negative weights (train,valid,test; e.g. 969,30,1)");
        w.push_back(x);
    }
    ST_CHECK(!w.empty() && w.size() <= 3, "recipe key 'split': '", text,
             "' is not up to three non-negative weights (train,valid,test; e.g. 969,30,1)");
    std::array<double, 3> out{0, 0, 0};
    double sum = 0;
    for (size_t i = 0; i < w.size(); ++i) out[i] = w[i], sum += w[i];
    ST_CHECK(sum > 0, "recipe key 'split': '", text, "' gives every part weight 0");
    for (double& x : out) x /= sum;
    return out;
}

std::array<int64_t, 4> split_index(const std::array<double, 3>& weights, int64_t documents) {
    std::array<int64_t, 4> index{0, 0, 0, 0};
    for (int p = 0; p < 3; ++p)
        index[p + 1] = index[p] + int64_t(std::llround(weights[p] * double(documents)));
    const int64_t diff = index[3] - documents;
    for (int p = 1; p < 4; ++p) index[p] = std::clamp(index[p] - diff, index[p - 1], documents);
    return index;
}

}  // namespace sparsetron
