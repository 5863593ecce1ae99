#include "sparsetron/perf/report.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"
#include "sparsetron/io/durable.h"

namespace sparsetron {
namespace fs = std::filesystem;
namespace {

const char* kPage = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sparsetron performance report</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.chart { width: 900px; height: 360px; }
#errors { color: #b00; white-space: pre-wrap; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 3px 8px; }
</style></head>
<body data-charts="0">
<h1>Sparsetron performance report</h1>
<p id="summary"></p>
<pre id="errors"></pre>
<h2>Step time per variant (latest commit of each recipe and variant)</h2>
<div class="chart"><canvas id="steps"></canvas></div>
<h2>Audited TFLOPS per GPU across commits</h2>
<div class="chart"><canvas id="tflops"></canvas></div>
<h2>Peak device memory across commits (MiB)</h2>
<div class="chart"><canvas id="memory"></canvas></div>
<h2 id="flops-title">FLOPs per step by term (TFLOP)</h2>
<div class="chart"><canvas id="flops"></canvas></div>
<h2>Records</h2>
<table id="records"></table>
/*LIBRARY*/
<script>
const DATA = /*DATA*/;
let made = 0;
function chart(id, config) {
  const canvas = document.getElementById(id);
  config.options = Object.assign({animation: false, responsive: true, maintainAspectRatio: false},
                                 config.options || {});
  const c = new Chart(canvas, config);
  if (!Chart.getChart(canvas)) { fail('chart ' + id + ' was not created'); return; }
  canvas.dataset.rendered = 'yes';
  made += 1;
}
try {
  const recs = DATA.records;
  const key = r => r.recipe + ' | ' + r.variant;
  const keys = [...new Set(recs.map(key))];
  const commits = [...new Set(recs.map(r => r.commit))];
  const palette = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#8c564b', '#17becf'];
  document.getElementById('summary').textContent =
      recs.length + ' records, ' + commits.length + ' commits, GPUs: ' +
      [...new Set(recs.map(r => r.gpu))].join(', ');
  // Step-time distributions: every timed iteration of the latest record of each key.
  const latest = keys.map(k => recs.filter(r => key(r) === k).slice(-1)[0]);
  chart('steps', {type: 'scatter', data: {datasets: latest.map((r, i) => ({
      label: key(r) + ' @ ' + r.commit, backgroundColor: palette[i % palette.length],
      data: r.step_ms.map((ms, j) => ({x: i + (j + 0.5) / (r.step_ms.length + 1) - 0.5, y: ms}))}))},
    options: {scales: {x: {type: 'linear', min: -0.6, max: latest.length - 0.4,
                           ticks: {stepSize: 1, callback: v => (latest[v] ? latest[v].variant : '')}},
                       y: {title: {display: true, text: 'ms per step'}}}}});
  const series = (field) => keys.map((k, i) => ({label: k, borderColor: palette[i % palette.length],
      backgroundColor: palette[i % palette.length],
      data: commits.map(c => { const r = recs.filter(x => key(x) === k && x.commit === c).slice(-1)[0];
                               return r ? r[field] : null; }), spanGaps: true}));
  chart('tflops', {type: 'line', data: {labels: commits, datasets: series('tflops_per_gpu')}});
  chart('memory', {type: 'line', data: {labels: commits, datasets: series('peak_mem_mib')}});
  const f = DATA.flops;
  document.getElementById('flops-title').textContent = 'FLOPs per step by term (TFLOP): ' + f.title;
  chart('flops', {type: 'bar', data: {labels: f.terms.map(t => t[0]),
      datasets: [{label: 'TFLOP', backgroundColor: '#1f77b4', data: f.terms.map(t => t[1] / 1e12)}]}});
  // The seed's cross-rank columns: each rank's p95 and CV, smallest to largest over the ranks
  // (records of older benches have none).
  const span = (v, scale, digits) => (Array.isArray(v) && v.length === 2)
      ? (v[0] * scale).toFixed(digits) + '-' + (v[1] * scale).toFixed(digits) : '';
  const rows = ['<tr><th>commit</th><th>recipe</th><th>variant</th><th>gpu</th><th>median ms</th>' +
                '<th>p95 ms</th><th>p95 ms over ranks</th><th>CV % over ranks</th>' +
                '<th>TFLOPS</th><th>tokens/s</th><th>peak MiB</th></tr>'];
  for (const r of recs)
    rows.push('<tr><td>' + [r.commit, r.recipe, r.variant, r.gpu, r.median_ms.toFixed(1),
        r.p95_ms.toFixed(1), span(r.p95_ms_range, 1, 1), span(r.cv_range, 100, 2),
        r.tflops_per_gpu.toFixed(1), r.tokens_per_s_per_gpu.toFixed(0),
        r.peak_mem_mib.toFixed(0)].join('</td><td>') + '</td></tr>');
  document.getElementById('records').innerHTML = rows.join('');
} catch (e) {
  fail(e && e.stack ? e.stack : e);
}
document.body.dataset.charts = String(made);
</script>
</body></html>
)HTML";

// Text placed inside <script>: a literal "</script" would end the element early (in JS source
// and JSON it only occurs inside strings, where "<\/" means the same).
std::string script_safe(std::string s) {
    for (size_t at = 0; (at = s.find("</script", at)) != std::string::npos; at += 9)
        s.replace(at, 2, "<\\/");
    return s;
}

}  // namespace

void write_report_page(std::string page, const std::string& chartjs_path,
                       const std::string& data_json, const std::string& out_html) {
    auto put = [&](const std::string& mark, const std::string& text) {
        const size_t at = page.find(mark);
        ST_ASSERT(at != std::string::npos, "report template lost ", mark);
        page.replace(at, mark.size(), text);
    };
    // The error capture first, so the chart library's own errors are caught too.
    put("/*LIBRARY*/", R"HTML(<script>
const errors = [];
function fail(m) {
  errors.push(String(m));
  document.getElementById('errors').textContent = errors.join('\n');
}
window.addEventListener('error', e => fail(e.message));
const consoleError = console.error;
console.error = (...a) => { fail(a.join(' ')); consoleError(...a); };
</script>
<script>/*CHARTJS*/</script>)HTML");
    put("/*CHARTJS*/",
        script_safe(read_text(chartjs_path.empty() ? find_chartjs() : chartjs_path)));
    put("/*DATA*/", script_safe(data_json));
    std::ofstream out(out_html, std::ios::binary | std::ios::trunc);
    ST_CHECK(out.good(), "cannot write '", out_html, "'");
    out << page;
}

std::string find_chartjs() {
    std::vector<std::string> tried;
    if (const auto env = env_value("SPARSETRON_CHARTJS")) tried.push_back(*env);
    tried.push_back(std::string(SPARSETRON_SOURCE_DIR) +
                    "/tools/report/node_modules/chart.js/dist/chart.umd.js");
    tried.emplace_back("tools/report/node_modules/chart.js/dist/chart.umd.js");
    for (const auto& p : tried)
        if (fs::is_regular_file(p)) return p;
    throw Error(cat("Chart.js not found (looked in ", tried[tried.size() - 2], " and ./",
                    tried.back(),
                    "; set SPARSETRON_CHARTJS); run scripts/setup.sh, which "
                    "installs it with npm"));
}

int write_report(const ReportInput& in, const std::string& out_html) {
    ST_CHECK(!in.history_files.empty(), "report: no --history file");
    nlohmann::json recs = nlohmann::json::array();
    nlohmann::json flops = nullptr;
    for (const auto& path : in.history_files) {
        std::ifstream f(path);
        ST_CHECK(f.good(), "cannot read history file '", path, "'");
        std::string line;
        for (int no = 1; std::getline(f, line); ++no) {
            if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
            nlohmann::json r;
            try {
                r = nlohmann::json::parse(line);
                for (const char* k : {"recipe", "gpu", "commit", "variant"})
                    r.at(k).get<std::string>();
                for (const char* k : {"median_ms", "p95_ms", "tflops_per_gpu",
                                      "tokens_per_s_per_gpu", "peak_mem_mib"})
                    r.at(k).get<double>();
                ST_CHECK(!r.at("step_ms").empty(), "");
            } catch (const std::exception& e) {
                throw Error(cat(path, ":", no, ": not a bench record (", e.what(),
                                "); expected one `sparsetron bench --json` line"));
            }
            if (r.contains("flops_terms")) {
                // [[term, flops], ...] as bench writes it, or {term: flops, ...}.
                nlohmann::json terms = nlohmann::json::array();
                const auto& t = r["flops_terms"];
                if (t.is_object())
                    for (auto& [k, v] : t.items()) terms.push_back({k, v});
                else
                    terms = t;
                flops = nlohmann::json::object();
                flops["title"] =
                    r["recipe"].get<std::string>() + " @ " + r["commit"].get<std::string>();
                flops["terms"] = terms;
            }
            recs.push_back(std::move(r));
        }
    }
    ST_CHECK(!recs.empty(), "report: the history files hold no records");
    if (flops.is_null()) {
        ST_CHECK(!in.flops_terms.empty(),
                 "report: no record carries a FLOPs breakdown; pass "
                 "--recipe R to draw the recipe's");
        flops = nlohmann::json::object();
        flops["title"] = in.flops_title;
        flops["terms"] = nlohmann::json::array();
        for (auto& [k, v] : in.flops_terms) flops["terms"].push_back({k, v});
    }
    nlohmann::json data;
    data["records"] = recs;
    data["flops"] = flops;
    write_report_page(kPage, in.chartjs_path, data.dump(), out_html);
    return int(recs.size());
}

}  // namespace sparsetron
