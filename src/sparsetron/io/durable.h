// Durable file-system steps for checkpoints and metrics: data reaches the disk before a rename
// publishes it, and the rename itself is on disk before anything points at it (a crash or power
// loss leaves either the old state or the new one, never a name for a file whose bytes were lost).
#pragma once

#include <string>

namespace sparsetron {

// fsync of a file or a directory; throws naming `path` when it fails.
void sync_path(const std::string& path);

// Syncs `from` (file or directory), renames it to `to`, then syncs `to`'s parent directory.
void rename_durably(const std::string& from, const std::string& to);

// Writes `text` to `path` through `path`.tmp and rename_durably (never half-written).
void write_text_durably(const std::string& path, const std::string& text);
// The whole file; throws naming it when it cannot be read.
std::string read_text(const std::string& path);

// Removes the temporary directories (".tmp-iter_N-PID", ".old-iter_N-PID") that saves killed
// before their rename left in `save_dir`: those whose PID is no longer a running process.
// Returns how many it removed.
int remove_stale_temporaries(const std::string& save_dir);

}  // namespace sparsetron
