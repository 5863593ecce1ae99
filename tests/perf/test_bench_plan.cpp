// Bench plans (perf/bench_plan.h): a plan file's rows parse as written, the repository's plans
// load, and a malformed plan stops naming the file and the field.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "sparsetron/perf/bench_plan.h"
#include "test_util.h"

using namespace sparsetron;

namespace {
std::string write_plan(const std::string& name, const std::string& text) {
    const std::string path = test::temp_dir("bench-plan") + "/" + name;
    std::ofstream(path) << text;
    return path;
}
}  // namespace

TEST(BenchPlan, RowsParseAsWritten) {
    const std::string path = write_plan("ok.yaml", R"(recipe: recipes/glm5.2-proxy-h200.yaml
warmup: 1
iters: 4
rows:
  - name: backbone
    set: [mtp_num_layers=0, dsa_indexer_loss_coeff=0]
    forward_backward: true
    lengths: [4096, 32768]
    variants: [eager, graph]
  - name: step
  - name: data
    variants: [eager, graph]
    data: true
)");
    const BenchPlan p = load_bench_plan(path);
    EXPECT_EQ(p.recipe, "recipes/glm5.2-proxy-h200.yaml");
    EXPECT_EQ(p.warmup, 1);
    EXPECT_EQ(p.iters, 4);
    ASSERT_EQ(p.rows.size(), 3u);
    EXPECT_FALSE(p.rows[0].data);
    EXPECT_TRUE(p.rows[2].data);
    EXPECT_EQ(p.rows[0].name, "backbone");
    EXPECT_EQ(p.rows[0].overrides,
              (std::vector<std::string>{"mtp_num_layers=0", "dsa_indexer_loss_coeff=0"}));
    EXPECT_TRUE(p.rows[0].forward_backward);
    EXPECT_EQ(p.rows[0].lengths, (std::vector<int64_t>{4096, 32768}));
    EXPECT_EQ(p.rows[0].variants, (std::vector<std::string>{"eager", "graph"}));
    EXPECT_FALSE(p.rows[1].forward_backward);
    EXPECT_TRUE(p.rows[1].lengths.empty());
    EXPECT_EQ(p.rows[1].variants, std::vector<std::string>{"graph"});
}

TEST(BenchPlan, RepositoryPlansLoad) {
    int plans = 0;
    for (const auto& e :
         std::filesystem::directory_iterator(std::string(SPARSETRON_SOURCE_DIR) + "/bench/plans")) {
        SCOPED_TRACE(e.path().string());
        EXPECT_NO_THROW(load_bench_plan(e.path().string()));
        ++plans;
    }
    EXPECT_GE(plans, 2);
}

TEST(BenchPlan, MalformedPlansNameTheField) {
    const std::pair<const char*, const char*> cases[] = {
        {"rows:\n  - name: a\n", "no recipe"},
        {"recipe: r.yaml\nrows: []\n", "rows: a list of rows"},
        {"recipe: r.yaml\nrows:\n  - name: a\n    lengths: [0]\n", "rows[0].lengths: 0"},
        {"recipe: r.yaml\nrows:\n  - name: a\n    variants: [fast]\n", "rows[0].variants: 'fast'"},
        {"recipe: r.yaml\nrows:\n  - name: a\n    set: [seq_length]\n", "'seq_length' is not"},
        {"recipe: r.yaml\nrows:\n  - nmae: a\n", "unknown key 'nmae'"},
        {"recipe: r.yaml\nitres: 3\nrows:\n  - name: a\n", "unknown key 'itres'"},
        {"recipe: r.yaml\niters: 0\nrows:\n  - name: a\n", "iters > 0"},
        {"recipe: r.yaml\nrows:\n  - name: a\n    data: true\n    forward_backward: true\n",
         "no forward_backward"},
    };
    int i = 0;
    for (const auto& [text, expect] : cases) {
        const std::string path = write_plan(cat("bad", i++, ".yaml"), text);
        const std::string msg = test::error_of([&] { load_bench_plan(path); });
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
        EXPECT_NE(msg.find(expect), std::string::npos) << text << " -> " << msg;
    }
}
