// metrics.jsonl, the run's step log: one JSON object per line, appended as steps finish. A
// resumed run continues the file from the iteration it resumed at.
#pragma once

#include <cstdint>
#include <string>

namespace sparsetron {

// Keeps the lines of steps <= `keep_through` (and drops the rest, which the resumed run writes
// again). Crash-safe: the kept lines go to a new file that replaces the old one by a rename, so a
// kill at any moment leaves either the whole old log or the whole trimmed one (the log is never
// rewritten in place). No file: nothing to do.
void trim_metrics_log(const std::string& path, int64_t keep_through);

}  // namespace sparsetron
