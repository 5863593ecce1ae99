// Helpers shared by the tests: temporary directories, random data, fp64 comparisons.
#pragma once

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"

namespace sparsetron::test {

// Runs `fn` and returns the message of the sparsetron::Error it throws ("" if none).
template <typename Fn>
std::string error_of(Fn&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

// A fresh, empty directory under the build tree for one test.
inline std::string temp_dir(const std::string& name) {
    namespace fs = std::filesystem;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    fs::path p = fs::path(SPARSETRON_TEST_TMP) /
                 (std::string(info->test_suite_name()) + "." + info->name() + "." + name);
    fs::remove_all(p);
    fs::create_directories(p);
    return p.string();
}

// A file's bytes ("" when it does not exist).
inline std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

// The number of lines in a file (0 when it does not exist).
inline int line_count(const std::string& path) {
    std::ifstream in(path);
    int n = 0;
    for (std::string line; std::getline(in, line);) ++n;
    return n;
}

// Deterministic non-zero random values in [-scale, scale] (never all zeros).
template <typename T>
std::vector<T> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
    CounterRng rng(seed, 77);
    std::vector<T> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<T>((2.0 * rng.uniform(i) - 1.0) * scale);
    return v;
}

// max |a-b| / max(1, max|b|): a normalized error that is meaningful for any magnitude.
template <typename A, typename B>
double max_rel_error(const std::vector<A>& a, const std::vector<B>& b) {
    EXPECT_EQ(a.size(), b.size());
    double err = 0, ref = 1e-30;
    for (size_t i = 0; i < a.size(); ++i) {
        err = std::max(err, std::fabs(double(a[i]) - double(b[i])));
        ref = std::max(ref, std::fabs(double(b[i])));
    }
    return err / std::max(1.0, ref);
}

// The small model the runtime tests train (seconds per run on CPU, also under the sanitizers):
// its recipe overrides, and the same as CLI options.
inline std::vector<std::string> small_model_sets() {
    return {"hidden_size=48",  "num_attention_heads=2", "q_lora_rank=32",
            "kv_lora_rank=24", "qk_head_dim=16",        "qk_pos_emb_head_dim=8",
            "v_head_dim=16",   "ffn_hidden_size=96",    "seq_length=64"};
}
inline std::string small_model_cli() {
    std::string s;
    for (const std::string& set : small_model_sets()) s += " --set " + set;
    return s;
}
// A quiet CLI run of the small model, two sequences per step.
inline std::string small_run_cli() {
    return small_model_cli() + " --set global_batch_size=2 -q";
}

// Runs the `sparsetron` CLI built with the tests; stdout and stderr together.
struct CliRun {
    int code;
    std::string output;
};
// Runs the CLI with `args`; `env` ("NAME=value ...") is set for that process only.
inline CliRun run_cli(const std::string& args, const std::string& env = "") {
    const std::string cmd = (env.empty() ? "" : "env " + env + " ") + std::string(SPARSETRON_CLI) +
                            " " + args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    const int status = pclose(p);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace sparsetron::test
