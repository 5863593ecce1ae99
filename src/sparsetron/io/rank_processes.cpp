#include "sparsetron/io/rank_processes.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace sparsetron {

std::string this_host_name() {
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
    return name;
}

void write_rank_process(const std::string& out_dir, int rank) {
    const fs::path dir = fs::path(out_dir) / ".ranks";
    std::error_code ec;
    fs::create_directories(dir, ec);
    // Best effort: a run that cannot record itself still trains (`stop` then names no process).
    std::ofstream(dir / ("rank" + std::to_string(rank)), std::ios::trunc)
        << ::getpid() << " " << this_host_name() << "\n";
}

std::vector<RankProcess> read_rank_processes(const std::string& out_dir) {
    std::vector<RankProcess> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(fs::path(out_dir) / ".ranks", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("rank", 0) != 0 || name.size() == 4 ||
            !std::all_of(name.begin() + 4, name.end(), ::isdigit) || name.size() > 10)
            continue;
        RankProcess p;
        p.rank = std::stoi(name.substr(4));
        std::ifstream in(entry.path());
        if (!(in >> p.pid >> p.host) || p.pid <= 0) continue;
        out.push_back(p);
    }
    std::sort(out.begin(), out.end(),
              [](const RankProcess& a, const RankProcess& b) { return a.rank < b.rank; });
    return out;
}

bool is_live_sparsetron_process(const RankProcess& p) {
    if (p.host != this_host_name()) return false;
    // argv[0] of the process: a PID reused by another program since is left alone.
    std::ifstream cmdline("/proc/" + std::to_string(p.pid) + "/cmdline");
    std::string argv0;
    if (!std::getline(cmdline, argv0, '\0')) return false;
    return fs::path(argv0).filename().string().rfind("sparsetron", 0) == 0;
}

}  // namespace sparsetron
