// `sparsetron report --run DIR`: one self-contained HTML page of training runs' curves from their
// metrics.jsonl: train and validation LM loss, MTP loss and acceptance length, indexer loss,
// gradient norm, learning rate, throughput, and a heat map of the routed experts' load per step.
// Chart.js is inlined as in the benchmark report (perf/report.h).
#pragma once

#include <string>
#include <vector>

namespace sparsetron {

// `run_dirs`: directories holding metrics.jsonl (or the files themselves). Returns the number
// of steps drawn. Throws with file:line on a malformed line.
int write_run_report(const std::vector<std::string>& run_dirs, const std::string& out_html,
                     const std::string& chartjs_path = "");

}  // namespace sparsetron
