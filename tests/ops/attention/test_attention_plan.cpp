// The sparse attention's plan (ops/attention/attention_plan.h), on the CPU: docs/cuda.md's table
// of forms and its examples agree with plan_sparse_attention, and the plan's rules hold (the forms
// a problem supports, context parallelism, kept probabilities, query blocks).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/attention/attention_plan.h"

using namespace sparsetron;
using namespace sparsetron::cuda;

namespace {

std::vector<std::string> cells(const std::string& row) {
    std::vector<std::string> out;
    std::stringstream ss(row.substr(1));
    std::string c;
    while (std::getline(ss, c, '|')) {
        const size_t a = c.find_first_not_of(" `"), b = c.find_last_not_of(" `");
        out.push_back(a == std::string::npos ? "" : c.substr(a, b - a + 1));
    }
    return out;
}

// The rows of the markdown table under `heading` whose header row starts with `first` in
// docs/cuda.md (each row as its cells).
std::vector<std::vector<std::string>> doc_table(const std::string& heading,
                                                const std::string& first) {
    std::ifstream in(std::string(SPARSETRON_SOURCE_DIR) + "/docs/cuda.md");
    std::string line;
    bool in_section = false, in_table = false;
    std::vector<std::vector<std::string>> rows;
    while (std::getline(in, line)) {
        if (line.rfind("#", 0) == 0) {
            if (in_section && !in_table) continue;
            in_section = line == heading;
            if (!in_section && in_table) break;
            continue;
        }
        if (!in_section) continue;
        if (line.rfind("|", 0) != 0) {
            if (in_table) break;
            continue;
        }
        const auto c = cells(line);
        if (!in_table) {
            in_table = !c.empty() && c[0] == first;
            continue;
        }
        if (c[0].rfind("---", 0) == 0) continue;
        rows.push_back(c);
    }
    return rows;
}

SparseAttentionProblem glm(int64_t tokens, int64_t key_rows = 0) {
    return {.tokens = tokens,
            .key_rows = key_rows,
            .heads = 64,
            .dqk = 576,
            .dv = 512,
            .topk = 2048,
            .sm90a = true,
            .block_rows = 16384,
            .saved_probs_max = int64_t(1) << 40};
}

}  // namespace

TEST(Attention, FormsTableNamesEveryFormOnce) {
    const auto rows = doc_table("### Sparse attention forms", "form");
    std::map<std::string, int> seen;
    for (const auto& r : rows) ++seen[r[0]];
    for (SparseAttentionForm f : all_sparse_attention_forms())
        EXPECT_EQ(seen[form_name(f)], 1) << form_name(f) << " in docs/cuda.md's forms table";
    EXPECT_EQ(rows.size(), all_sparse_attention_forms().size());
}

TEST(Attention, PlanMatchesTheDocsTable) {
    const auto rows = doc_table("### Sparse attention forms", "tokens");
    ASSERT_GE(rows.size(), 8u) << "docs/cuda.md's examples of the sparse attention plan";
    for (const auto& r : rows) {
        ASSERT_EQ(r.size(), 11u);
        SparseAttentionProblem p;
        p.tokens = std::stoll(r[0]);
        p.key_rows = std::stoll(r[1]);
        p.heads = std::stoll(r[2]);
        p.dqk = std::stoll(r[3]);
        p.dv = std::stoll(r[4]);
        p.topk = std::stoll(r[5]);
        p.sm90a = r[6] == "yes";
        p.teacher = r[7] == "sparse"  ? IndexerTeacher::Sparse
                    : r[7] == "dense" ? IndexerTeacher::Dense
                                      : IndexerTeacher::None;
        p.shared_keys = r[8] == "yes";
        p.saved_probs_max = std::stoll(r[9]) << 20;
        const SparseAttentionPlan plan = plan_sparse_attention(p);
        EXPECT_EQ(form_name(plan.form), r[10]) << "docs/cuda.md example row: " << r[0] << " "
                                               << r[1] << " " << r[2] << " heads, " << r[7];
        // The plan's form is one the problem supports.
        const auto ok = supported_forms(p);
        EXPECT_NE(std::find(ok.begin(), ok.end(), plan.form), ok.end()) << r[10];
    }
}

TEST(Attention, PlanRules) {
    // The masked forms take a workspace and the others none; the proxy's 4K layer keeps P only
    // within the bound.
    SparseAttentionProblem p = glm(4096);
    p.teacher = IndexerTeacher::Dense;
    SparseAttentionPlan keep = plan_sparse_attention(p);
    EXPECT_EQ(keep.form, SparseAttentionForm::AbsorbedMasked);
    EXPECT_GT(keep.workspace_bytes, 0);
    EXPECT_EQ(keep.saved_probs_elems, sparse_mqa_saved_probs_elems(4096, 64, keep.workspace_bytes));
    p.saved_probs_max = keep.saved_probs_elems * 2 - 2;
    const SparseAttentionPlan over = plan_sparse_attention(p);
    EXPECT_EQ(over.form, SparseAttentionForm::AbsorbedFlashMasked);
    EXPECT_EQ(over.saved_probs_elems, 0);
    EXPECT_EQ(over.workspace_bytes, keep.workspace_bytes);
    // Context parallelism: no expanded form, nothing kept, no query blocks.
    SparseAttentionProblem cp = glm(2048, 4096);
    cp.recompute_up = cp.recompute_core = true;
    for (SparseAttentionForm f : supported_forms(cp)) {
        EXPECT_NE(f, SparseAttentionForm::ExpandedMasked);
        const SparseAttentionPlan plan = plan_sparse_attention(cp, f);
        EXPECT_EQ(plan.saved_probs_elems, 0) << form_name(f);
        EXPECT_EQ(plan.query_block_rows, 2048) << form_name(f);
    }
    EXPECT_THROW(plan_sparse_attention(cp, SparseAttentionForm::ExpandedMasked), Error);
    // Query blocks: the gathered forms with core and up-projection recomputed and no teacher.
    SparseAttentionProblem longer = glm(131072);
    EXPECT_EQ(plan_sparse_attention(longer).query_block_rows, 131072);
    longer.recompute_up = longer.recompute_core = true;
    EXPECT_EQ(plan_sparse_attention(longer).form, SparseAttentionForm::AbsorbedFlash);
    EXPECT_EQ(plan_sparse_attention(longer).query_block_rows, 16384);
    longer.teacher = IndexerTeacher::Sparse;
    EXPECT_EQ(plan_sparse_attention(longer).query_block_rows, 131072);
    longer.teacher = IndexerTeacher::None;
    longer.fp8 = true;
    EXPECT_EQ(plan_sparse_attention(longer).query_block_rows, 131072);
    // Past the mask kernels' shared memory no masked form is supported at all.
    const auto huge = supported_forms(glm(1 << 20));
    EXPECT_EQ(std::count(huge.begin(), huge.end(), SparseAttentionForm::AbsorbedMasked), 0);
    // The masked workspace holds one chunk of every query row at short contexts.
    EXPECT_EQ(sparse_mqa_masked_workspace_bytes(200, 8), 200 * 8 * 208 * 10);
}
