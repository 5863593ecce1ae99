#include "sparsetron/io/durable.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "sparsetron/core/error.h"

namespace fs = std::filesystem;

namespace sparsetron {

void sync_path(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ST_CHECK(fd >= 0, "cannot open '", path, "' to sync it: ", std::strerror(errno));
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    // Some file systems cannot sync a directory (EINVAL): their renames are durable anyway.
    ST_CHECK(rc == 0 || err == EINVAL, "syncing '", path, "' to disk failed: ", std::strerror(err));
}

void write_text_durably(const std::string& path, const std::string& text) {
    const std::string tmp = path + ".tmp";
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        ST_CHECK(out.good(), "cannot write '", tmp, "'");
        out << text;
        out.flush();
        ST_CHECK(out.good(), "writing '", tmp, "' failed (disk full?)");
    }
    rename_durably(tmp, path);
}

std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    ST_CHECK(in.good(), "cannot read '", path, "'");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

void rename_durably(const std::string& from, const std::string& to) {
    sync_path(from);
    std::error_code ec;
    fs::rename(from, to, ec);
    ST_CHECK(!ec, "renaming '", from, "' to '", to, "' failed: ", ec.message());
    fs::path parent = fs::path(to).parent_path();
    sync_path(parent.empty() ? "." : parent.string());
}

namespace {

// The PID a temporary name ends with ("-1234"), or -1.
long trailing_pid(const std::string& name) {
    const size_t dash = name.rfind('-');
    if (dash == std::string::npos || dash + 1 == name.size()) return -1;
    long pid = 0;
    for (size_t i = dash + 1; i < name.size(); ++i) {
        if (name[i] < '0' || name[i] > '9') return -1;
        pid = pid * 10 + (name[i] - '0');
        if (pid > 1L << 30) return -1;
    }
    return pid;
}

bool process_alive(long pid) {
    return pid > 0 && (::kill(pid_t(pid), 0) == 0 || errno == EPERM);
}

}  // namespace

int remove_stale_temporaries(const std::string& save_dir) {
    std::error_code ec;
    if (!fs::is_directory(save_dir, ec)) return 0;
    int removed = 0;
    for (const auto& e : fs::directory_iterator(save_dir, ec)) {
        const std::string name = e.path().filename().string();
        if (name.rfind(".tmp-iter_", 0) != 0 && name.rfind(".old-iter_", 0) != 0) continue;
        const long pid = trailing_pid(name);
        if (pid < 0 || process_alive(pid)) continue;  // a sharded save's name, or a live save
        fs::remove_all(e.path(), ec);
        if (!ec) ++removed;
    }
    return removed;
}

}  // namespace sparsetron
