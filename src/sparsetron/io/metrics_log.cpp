#include "sparsetron/io/metrics_log.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/core/error.h"
#include "sparsetron/io/durable.h"

namespace fs = std::filesystem;

namespace sparsetron {

void trim_metrics_log(const std::string& path, int64_t keep_through) {
    if (!fs::exists(path)) return;
    const std::string tmp = path + ".tmp";
    {
        std::ifstream in(path);
        ST_CHECK(in.good(), "cannot read '", path, "'");
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        ST_CHECK(out.good(), "cannot write '", tmp, "'");
        for (std::string line; std::getline(in, line);) {
            try {
                if (nlohmann::json::parse(line).at("step").get<int64_t>() <= keep_through)
                    out << line << '\n';
            } catch (const std::exception&) {
                // A line a crash cut short, or not a step's: not part of the continued log.
            }
        }
        out.flush();
        ST_CHECK(out.good(), "writing '", tmp, "' failed (disk full?)");
    }
    rename_durably(tmp, path);
}

}  // namespace sparsetron
