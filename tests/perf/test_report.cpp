// `sparsetron report`: the HTML page is self-contained and renders every chart in headless
// Chromium without a script error (label cpu; CI installs Debian's chromium via setup.sh).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "test_util.h"

using namespace sparsetron;
namespace fs = std::filesystem;

namespace {

std::string chromium() {
    if (const char* e = std::getenv("SPARSETRON_CHROMIUM")) return e;
    for (const char* p : {"/usr/bin/chromium", "/usr/bin/chromium-browser"})
        if (fs::exists(p)) return p;
    return "";
}

struct Rendered {
    std::string dom;
    int charts = -1;
    int rendered = 0;
    std::string errors;
};

// Loads the page in headless Chromium and reads back what its script wrote into the DOM.
Rendered render(const std::string& html, const std::string& dir) {
    const std::string exe = chromium();
    EXPECT_FALSE(exe.empty()) << "headless Chromium not found: run scripts/setup.sh (installs "
                                 "Debian's chromium) or set SPARSETRON_CHROMIUM";
    Rendered r;
    if (exe.empty()) return r;
    const std::string cmd = "timeout 120 " + exe +
                            " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage "
                            "--user-data-dir=" +
                            dir +
                            "/chromium-profile "
                            "--virtual-time-budget=5000 --dump-dom file://" +
                            fs::absolute(html).string() + " 2>" + dir + "/chromium.log";
    FILE* p = popen(cmd.c_str(), "r");
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.dom.append(buf, n);
    pclose(p);
    std::smatch m;
    if (std::regex_search(r.dom, m, std::regex("data-charts=\"([0-9]+)\"")))
        r.charts = std::stoi(m[1]);
    for (size_t at = 0; (at = r.dom.find("data-rendered=\"yes\"", at)) != std::string::npos; ++at)
        ++r.rendered;
    if (std::regex_search(r.dom, m, std::regex("id=\"errors\">([^<]*)<"))) r.errors = m[1];
    return r;
}

void write_history(const std::string& path) {
    std::ofstream out(path);
    for (const char* commit : {"1111111", "2222222"})
        for (const char* variant : {"eager", "graph"}) {
            nlohmann::json r;
            r["recipe"] = "recipes/glm5.2-proxy-h200.yaml";
            r["gpu"] = "NVIDIA H200";
            r["commit"] = commit;
            r["variant"] = variant;
            r["step_ms"] = {5012.5, 5020.1, 4998.7, 5031.0};
            r["median_ms"] = 5016.3;
            r["p95_ms"] = 5029.6;
            r["tflops_per_gpu"] = std::string(variant) == "graph" ? 64.1 : 62.5;
            r["tokens_per_s_per_gpu"] = 816.5;
            r["peak_mem_mib"] = 113102.8;
            if (std::string(commit) == "2222222") {  // a bench of several ranks: their ranges
                r["p95_ms_range"] = {5021.4, 5043.9};
                r["cv_range"] = {0.0021, 0.0047};
            }
            r["flops_terms"] = {{"mlp", 8.6e13}, {"output_heads", 1.4e14}};
            out << r.dump() << "\n";
        }
}

}  // namespace

TEST(Report, SelfContainedPageRendersEveryChartInHeadlessChromium) {
    const std::string dir = test::temp_dir("report");
    write_history(dir + "/history.jsonl");
    auto run = test::run_cli("report --history " + dir + "/history.jsonl --out " + dir + "/r.html");
    ASSERT_EQ(run.code, 0) << run.output;
    std::ifstream in(dir + "/r.html");
    const std::string page((std::istreambuf_iterator<char>(in)), {});
    // Self-contained: Chart.js is inlined, nothing is fetched.
    EXPECT_NE(page.find("Chart.js v4"), std::string::npos);
    EXPECT_EQ(page.find("<script src"), std::string::npos);
    EXPECT_EQ(page.find("<link"), std::string::npos);
    Rendered r = render(dir + "/r.html", dir);
    EXPECT_EQ(r.charts, 4) << r.dom.substr(0, 2000);
    EXPECT_EQ(r.rendered, 4);
    EXPECT_EQ(r.errors, "");
    EXPECT_NE(r.dom.find("4 records, 2 commits"), std::string::npos);
    // The cross-rank columns: the ranges where a record has them.
    EXPECT_NE(r.dom.find("<td>5021.4-5043.9</td><td>0.21-0.47</td>"), std::string::npos)
        << r.dom.substr(r.dom.find("<table"), 3000);
}

TEST(Report, TheChromiumCheckCatchesABrokenPage) {
    // Chart.js replaced by a script that throws: the page must report the error and no chart.
    const std::string dir = test::temp_dir("broken");
    write_history(dir + "/history.jsonl");
    std::ofstream(dir + "/broken.js") << "throw new Error('broken chart library');";
    auto run = test::run_cli("report --history " + dir + "/history.jsonl --out " + dir + "/r.html");
    ASSERT_EQ(run.code, 0) << run.output;
    setenv("SPARSETRON_CHARTJS", (dir + "/broken.js").c_str(), 1);
    auto broken =
        test::run_cli("report --history " + dir + "/history.jsonl --out " + dir + "/bad.html");
    unsetenv("SPARSETRON_CHARTJS");
    ASSERT_EQ(broken.code, 0) << broken.output;
    Rendered r = render(dir + "/bad.html", dir);
    EXPECT_EQ(r.charts, 0);
    EXPECT_NE(r.errors.find("broken chart library"), std::string::npos) << r.errors;
}

TEST(Report, MalformedHistoryNamesTheFileAndLine) {
    const std::string dir = test::temp_dir("bad");
    write_history(dir + "/h.jsonl");
    std::ofstream(dir + "/h.jsonl", std::ios::app) << "{\"recipe\": \"x\"}\n";
    auto run = test::run_cli("report --history " + dir + "/h.jsonl --out " + dir + "/r.html");
    EXPECT_EQ(run.code, 1);
    EXPECT_NE(run.output.find(dir + "/h.jsonl:5: not a bench record"), std::string::npos)
        << run.output;
    auto none =
        test::run_cli("report --history " + dir + "/missing.jsonl --out " + dir + "/r.html");
    EXPECT_EQ(none.code, 1);
    EXPECT_NE(none.output.find("cannot read history file"), std::string::npos) << none.output;
}

// `report --run DIR`: a training run's curves (train and validation loss, MTP, indexer, grad
// norm, lr, throughput) and the expert-load heat map render in headless Chromium without a
// script error; a malformed metrics line is named.
TEST(Report, RunPageRendersEveryCurveAndTheExpertHeatMap) {
    const std::string dir = test::temp_dir("run");
    auto train = test::run_cli(
        "train -q --no-save --set train_iters=4 --set split=80,20,0 --set eval_interval=2"
        " --set eval_iters=1 --set global_batch_size=2" +
        test::small_model_cli() + " --out " + dir + "/a");
    ASSERT_EQ(train.code, 0) << train.output;
    auto run = test::run_cli("report --run " + dir + "/a --out " + dir + "/run.html");
    ASSERT_EQ(run.code, 0) << run.output;
    EXPECT_NE(run.output.find("4 steps"), std::string::npos) << run.output;
    Rendered r = render(dir + "/run.html", dir);
    EXPECT_EQ(r.charts, 7) << r.dom.substr(0, 2000);
    EXPECT_EQ(r.rendered, 7);
    EXPECT_EQ(r.errors, "");
    EXPECT_NE(r.dom.find("a: 4 steps"), std::string::npos);
    std::ofstream(dir + "/a/metrics.jsonl", std::ios::app) << "{\"step\": 5}\n";
    auto bad = test::run_cli("report --run " + dir + "/a --out " + dir + "/bad.html");
    EXPECT_EQ(bad.code, 1);
    EXPECT_NE(bad.output.find("metrics.jsonl:5: not a metrics line"), std::string::npos)
        << bad.output;
    auto neither = test::run_cli("report --out " + dir + "/x.html");
    EXPECT_EQ(neither.code, 1);
    EXPECT_NE(neither.output.find("--history FILE or --run DIR"), std::string::npos)
        << neither.output;
}
