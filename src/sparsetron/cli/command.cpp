#include "command.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "sparsetron/core/error.h"
#include "sparsetron/parallel/comm/launch_env.h"

namespace sparsetron::cli {

Device parse_device(const std::string& d) {
    if (d.empty()) return Device::CPU;
    if (d == "cpu") return Device::CPU;
    if (d == "cuda") return Device::CUDA;
    throw Error(cat("--device must be cpu or cuda, got '", d, "'"));
}

std::vector<std::string> split_list(const std::string& text) {
    std::vector<std::string> items;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ','))
        if (!item.empty()) items.push_back(item);
    return items;
}

std::vector<int64_t> step_documents(const Recipe& r, const std::string& lengths) {
    std::vector<int64_t> docs;
    if (!lengths.empty()) {
        std::stringstream ss(lengths);
        std::string item;
        while (std::getline(ss, item, ',')) {
            try {
                size_t used = 0;
                const long long v = std::stoll(item, &used);
                ST_CHECK(used == item.size() && v > 0, "");
                docs.push_back(v);
            } catch (const std::exception&) {
                throw Error(cat("--doc-lengths: '", item, "' is not a positive integer"));
            }
        }
        ST_CHECK(!docs.empty(), "--doc-lengths: no lengths given");
        return docs;
    }
    return std::vector<int64_t>(size_t(r.run.global_batch_size), r.run.seq_length);
}

namespace {
Comm* g_comm = nullptr;
std::unique_ptr<Comm> g_nccl;
}  // namespace

Comm* launch_comm() {
    return g_comm;
}
void set_launch_comm(Comm* comm) {
    g_comm = comm;
}

void connect_gpus_if_launched(Device device) {
    if (g_comm || device != Device::CUDA) return;
    const LaunchEnv env = detect_launch_env();
    if (env.world <= 1) return;
    g_nccl = make_nccl_comm(env);
    g_comm = g_nccl.get();
}

void add_json_output(CLI::App* command, JsonOutput& out, const std::string& what) {
    out.option = command
                     ->add_option("--json", out.file,
                                  what +
                                      " as JSON lines: appended to FILE, or on standard "
                                      "output (instead of the text) without one")
                     ->expected(0, 1);
}

void JsonOutput::write(const std::string& line) const {
    if (!wanted()) return;
    if (file.empty()) {
        std::printf("%s\n", line.c_str());
        std::fflush(stdout);
        return;
    }
    std::ofstream out(file, std::ios::app);
    out << line << "\n";
    out.flush();
    ST_CHECK(out.good(), "cannot write '", file, "'");
}

void print_newton_schulz(const NewtonSchulzCount& ns, const RunConfig& r) {
    if (ns.matrices == 0) return;
    auto flops = [](double f) {
        char b[32];
        std::snprintf(b, sizeof b, f >= 1e12 ? "%.1f TFLOP" : "%.2f GFLOP",
                      f >= 1e12 ? f / 1e12 : f / 1e9);
        return std::string(b);
    };
    std::printf("optimizer: muon | Newton-Schulz %s per step over %lld matrices",
                flops(ns.chosen_flops).c_str(), static_cast<long long>(ns.matrices));
    if (r.muon_ns_method == "gram")
        std::printf(", %lld in the Gram form (standard form: %s)",
                    static_cast<long long>(ns.gram_matrices), flops(ns.standard_flops).c_str());
    std::printf(" | not in the audited count\n");
}

}  // namespace sparsetron::cli
