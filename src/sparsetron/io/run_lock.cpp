#include "sparsetron/io/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "sparsetron/core/error.h"

namespace sparsetron {

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& what) {
    const std::string path = (std::filesystem::path(dir) / ".sparsetron.lock").string();
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    ST_CHECK(fd_ >= 0, "cannot open the run lock '", path, "': ", std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        char holder[32] = {};
        const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
        ::close(fd_);
        fd_ = -1;
        ST_CHECK(err != EWOULDBLOCK, what, " '", dir, "' is in use by another run (PID ",
                 n > 0 ? std::string(holder, size_t(n)) : std::string("unknown"), "): use another ",
                 what == "save directory" ? "`save`" : "--out", ", or wait for that run to end");
        throw Error(cat("cannot lock '", path, "': ", std::strerror(err)));
    }
    const std::string pid = std::to_string(::getpid());
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size()))
        throw Error(cat("cannot write the run lock '", path, "': ", std::strerror(errno)));
}

DirectoryLock::~DirectoryLock() {
    if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the flock
}

}  // namespace sparsetron
