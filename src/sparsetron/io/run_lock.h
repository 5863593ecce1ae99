// One run per directory: a run holds an exclusive lock on `<dir>/.sparsetron.lock` (the
// file names the holder's PID) for its lifetime, so a second run on the same directory stops at
// once instead of overwriting the first one's metrics and checkpoints. The lock is the kernel's
// (flock): it goes away with the process, however the process ends.
#pragma once

#include <string>

namespace sparsetron {

class DirectoryLock {
  public:
    // Throws, naming the directory (as `what`: "output directory", "save directory") and the
    // holder's PID, when another process holds it.
    explicit DirectoryLock(const std::string& dir, const std::string& what = "output directory");
    ~DirectoryLock();
    DirectoryLock(const DirectoryLock&) = delete;
    DirectoryLock& operator=(const DirectoryLock&) = delete;

  private:
    int fd_ = -1;
};

}  // namespace sparsetron
