// `sparsetron report`: one self-contained HTML page from bench history files (JSONL, one
// `sparsetron bench --json` record a line): step-time distributions per variant, audited TFLOPS
// and peak memory across commits, and the FLOPs breakdown, drawn with Chart.js inlined into the
// page (installed from npm by scripts/setup.sh into tools/report/node_modules).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace sparsetron {

struct ReportInput {
    std::vector<std::string> history_files;
    std::string chartjs_path;  // "" = find it (SPARSETRON_CHARTJS, then tools/report/node_modules)
    // Used when no record carries a breakdown: (term, FLOPs) from `sparsetron flops`.
    std::vector<std::pair<std::string, double>> flops_terms;
    std::string flops_title;
};

// Returns the number of records drawn. Throws with file:line on a malformed history line.
int write_report(const ReportInput& in, const std::string& out_html);

// Where the Chart.js UMD bundle is, or an error saying how to install it.
std::string find_chartjs();
// Writes an HTML report page: `page` holds /*LIBRARY*/ where the error capture and Chart.js
// go (its errors then land in the page's #errors element) and /*DATA*/ where the JSON goes.
void write_report_page(std::string page, const std::string& chartjs_path,
                       const std::string& data_json, const std::string& out_html);

}  // namespace sparsetron
