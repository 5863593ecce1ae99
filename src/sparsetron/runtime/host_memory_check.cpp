#include "sparsetron/runtime/host_memory_check.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include "sparsetron/core/error.h"
#include "sparsetron/core/memory_plan.h"

namespace sparsetron {

int64_t parameter_count_lower_bound(const ModelConfig& m) {
    // Per MoE layer: gate, up and down of every local expert. MTP layers take the last main
    // layer's kind.
    int64_t moe_layers = m.num_moe_layers();
    if (m.is_moe_layer(m.num_layers - 1)) moe_layers += m.mtp_physical_layers();
    const int64_t experts = m.num_experts / std::max<int64_t>(1, m.expert_parallel_ranks);
    return 2 * m.vocab_size * m.hidden_size +
           moe_layers * experts * 3 * m.hidden_size * m.moe_ffn_hidden_size;
}

uint64_t available_host_memory() {
    std::ifstream in("/proc/meminfo");
    for (std::string line; std::getline(in, line);) {
        if (line.rfind("MemAvailable:", 0) != 0) continue;
        std::istringstream fields(line.substr(13));
        uint64_t kib = 0;
        fields >> kib;
        return kib * 1024;
    }
    const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
}

void check_host_memory_for_training(const Recipe& recipe) {
    const uint64_t available = available_host_memory();
    if (available == 0) return;
    const int64_t params = parameter_count_lower_bound(recipe.model);
    const double need = double(params) * 4.0 * 3.0;  // fp32 weights, gradients, one moment
    ST_CHECK(need <= double(available), "the model has at least ", params,
             " parameters: their fp32 weights, gradients and optimizer state need at least ",
             format_bytes(need), " of host memory, and this machine has ",
             format_bytes(double(available)),
             " available (check num_experts, hidden_size and the FFN sizes, or train on GPUs "
             "with expert parallelism)");
}

double step_batch_host_bytes(int64_t count, int64_t slots, int64_t max_documents) {
    // tokens, targets and positions per slot, cu_seqlens per document; the step's and a copy.
    return 2.0 * double(count) * (3.0 * double(slots) + double(max_documents + 1)) *
           sizeof(int32_t);
}

void check_host_memory_for_batches(const Recipe& recipe, int64_t count, int64_t slots,
                                   int64_t max_documents) {
    const uint64_t available = available_host_memory();
    if (available == 0) return;
    const double need = step_batch_host_bytes(count, slots, max_documents);
    ST_CHECK(need <= double(available), "one step packs ", count, " micro-batches of ", slots,
             " token slots (global_batch_size ", recipe.run.global_batch_size, " x seq_length ",
             recipe.run.seq_length, "): their host buffers need ", format_bytes(need),
             ", and this machine has ", format_bytes(double(available)),
             " available; lower global_batch_size or seq_length");
}

void check_host_memory_for_cpu_plan(uint64_t plan_bytes) {
    const uint64_t available = available_host_memory();
    ST_CHECK(available == 0 || plan_bytes <= available, "the CPU memory plan (weights, gradients, ",
             "optimizer state and activations) needs ", format_bytes(double(plan_bytes)),
             " of host memory, and this machine has ", format_bytes(double(available)),
             " available; lower micro_batch_size, seq_length or the model's widths "
             "(`sparsetron plan` shows where the bytes go)");
}

}  // namespace sparsetron
