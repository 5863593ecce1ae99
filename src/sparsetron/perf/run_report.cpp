#include "sparsetron/perf/run_report.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparsetron/core/error.h"
#include "sparsetron/perf/report.h"

namespace sparsetron {
namespace fs = std::filesystem;
namespace {

const char* kRunPage = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sparsetron training report</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.chart { width: 900px; height: 320px; }
#errors { color: #b00; white-space: pre-wrap; }
</style></head>
<body data-charts="0">
<h1>Sparsetron training report</h1>
<p id="summary"></p>
<pre id="errors"></pre>
<h2>LM loss (train, validation)</h2>
<div class="chart"><canvas id="loss"></canvas></div>
<h2>MTP loss and acceptance length</h2>
<div class="chart"><canvas id="mtp"></canvas></div>
<h2>Indexer loss</h2>
<div class="chart"><canvas id="indexer"></canvas></div>
<h2>Gradient norm</h2>
<div class="chart"><canvas id="gradnorm"></canvas></div>
<h2>Learning rate</h2>
<div class="chart"><canvas id="lr"></canvas></div>
<h2>Throughput (tokens/s)</h2>
<div class="chart"><canvas id="throughput"></canvas></div>
<h2 id="heat-title">Routed expert load per step (share of the layer's rows, last MoE layer)</h2>
<canvas id="heat" width="900" height="240"></canvas>
/*LIBRARY*/
<script>
const DATA = /*DATA*/;
let made = 0;
const palette = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#8c564b', '#17becf'];
function chart(id, datasets, y2) {
  const canvas = document.getElementById(id);
  const scales = {x: {type: 'linear', title: {display: true, text: 'step'}}};
  if (y2) scales.y2 = {position: 'right', grid: {drawOnChartArea: false}};
  new Chart(canvas, {type: 'line', data: {datasets},
      options: {animation: false, responsive: true, maintainAspectRatio: false, scales,
                parsing: false, elements: {point: {radius: 0}}}});
  if (!Chart.getChart(canvas)) { fail('chart ' + id + ' was not created'); return; }
  canvas.dataset.rendered = 'yes';
  made += 1;
}
function series(run, i, field, label, extra) {
  const pts = run.steps.filter(s => s[field] !== undefined && s[field] !== null)
                       .map(s => ({x: s.step, y: s[field]}));
  return Object.assign({label: run.name + ': ' + label, data: pts,
                        borderColor: palette[i % palette.length],
                        backgroundColor: palette[i % palette.length]}, extra || {});
}
try {
  const runs = DATA.runs;
  document.getElementById('summary').textContent = runs.map(r => r.name + ': ' + r.steps.length +
      ' steps').join('; ');
  chart('loss', runs.flatMap((r, i) => [series(r, i, 'lm_loss', 'train'),
      series(r, i + 1, 'valid_lm_loss', 'validation', {borderDash: [6, 3], pointRadius: 3})]));
  chart('mtp', runs.flatMap((r, i) => [series(r, i, 'mtp_loss', 'MTP loss'),
      series(r, i + 2, 'mtp_acceptance_length', 'acceptance length', {yAxisID: 'y2'})]), true);
  chart('indexer', runs.map((r, i) => series(r, i, 'indexer_loss', 'indexer loss')));
  chart('gradnorm', runs.map((r, i) => series(r, i, 'grad_norm', 'grad norm')));
  chart('lr', runs.map((r, i) => series(r, i, 'lr', 'lr')));
  for (const r of runs) for (const s of r.steps) s.tokens_per_s = s.tokens * 1000 / s.step_ms;
  chart('throughput', runs.map((r, i) => series(r, i, 'tokens_per_s', 'tokens/s')));
  // Heat map: one column per step, one row per expert, darker = more of the layer's rows.
  const run = runs[0];
  const steps = run.steps.filter(s => s.moe_load && s.moe_load.length);
  const heat = document.getElementById('heat');
  if (steps.length) {
    const layer = steps[0].moe_load.length - 1, experts = steps[0].moe_load[layer].length;
    document.getElementById('heat-title').textContent += ' (' + run.name + ', MoE layer ' + layer +
        ', ' + experts + ' experts)';
    const g = heat.getContext('2d'), w = heat.width / steps.length, h = heat.height / experts;
    steps.forEach((s, c) => {
      const load = s.moe_load[layer], total = load.reduce((a, b) => a + b, 0) || 1;
      load.forEach((v, e) => {
        const share = Math.min(1, v / total * experts / 2);  // 0.5 = an even share
        g.fillStyle = 'rgb(' + Math.round(255 * (1 - share)) + ',' + Math.round(255 * (1 - share)) +
                      ',255)';
        g.fillRect(c * w, e * h, Math.ceil(w), Math.ceil(h));
      });
    });
    heat.dataset.rendered = 'yes';
    made += 1;
  }
} catch (e) {
  fail(e && e.stack ? e.stack : e);
}
document.body.dataset.charts = String(made);
</script>
</body></html>
)HTML";

}  // namespace

int write_run_report(const std::vector<std::string>& run_dirs, const std::string& out_html,
                     const std::string& chartjs_path) {
    ST_CHECK(!run_dirs.empty(), "report: no --run directory");
    nlohmann::json runs = nlohmann::json::array();
    int total = 0;
    for (const auto& dir : run_dirs) {
        const fs::path path =
            fs::is_directory(dir) ? fs::path(dir) / "metrics.jsonl" : fs::path(dir);
        std::ifstream f(path);
        ST_CHECK(f.good(), "cannot read '", path.string(),
                 "' (a run directory holds metrics.jsonl)");
        nlohmann::json steps = nlohmann::json::array();
        std::string line;
        for (int no = 1; std::getline(f, line); ++no) {
            if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
            try {
                nlohmann::json s = nlohmann::json::parse(line);
                for (const char* k : {"step", "lm_loss", "lr", "grad_norm", "tokens", "step_ms"})
                    s.at(k).get<double>();
                steps.push_back(std::move(s));
            } catch (const std::exception& e) {
                throw Error(cat(path.string(), ":", no, ": not a metrics line (", e.what(), ")"));
            }
        }
        ST_CHECK(!steps.empty(), path.string(), ": no steps");
        total += int(steps.size());
        nlohmann::json run;
        run["name"] = fs::path(dir).filename().string().empty()
                          ? fs::path(dir).parent_path().filename().string()
                          : fs::path(dir).filename().string();
        run["steps"] = std::move(steps);
        runs.push_back(std::move(run));
    }
    nlohmann::json data;
    data["runs"] = runs;
    write_report_page(kRunPage, chartjs_path, data.dump(), out_html);
    return total;
}

}  // namespace sparsetron
