#include "sparsetron/core/env.h"

#include <cstdlib>

#include "sparsetron/core/error.h"

namespace sparsetron {

const std::vector<EnvVar>& env_vars() {
    static const std::vector<EnvVar> vars = {
        {"SPARSETRON_NUM_THREADS", "CPU backend worker threads (default: the hardware's)"},
        {"SPARSETRON_DATA_DIR", "folder of the bundled corpus the built-in recipe trains on"},
        {"SPARSETRON_CHARTJS", "chart.umd.js for `sparsetron report` (default: tools/report)"},
        {"MASTER_ADDR", "rank 0's host for the multi-GPU rendezvous (default 127.0.0.1)"},
        {"MASTER_PORT", "rank 0's port for the multi-GPU rendezvous (default 29500)"},
        {"OMPI_COMM_WORLD_RANK", "rank under mpirun (with _SIZE and _LOCAL_RANK)"},
        {"OMPI_COMM_WORLD_SIZE", "world size under mpirun"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "rank on this node under mpirun (picks the GPU)"},
        {"OMPI_MCA_odls_base_sigkill_timeout",
         "mpirun's seconds between forwarding a stop signal and SIGKILL (default 1): rank 0 "
         "warns when a step takes longer"},
        {"RANK", "rank under torchrun"},
        {"WORLD_SIZE", "world size under torchrun"},
        {"LOCAL_RANK", "rank on this node under torchrun (picks the GPU)"},
        {"SLURM_PROCID", "rank under srun"},
        {"SLURM_NTASKS", "world size under srun"},
        {"SLURM_LOCALID", "rank on this node under srun (picks the GPU)"},
        {"CUDA_MODULE_LOADING",
         "CUDA's module loading; EAGER is required where ranks are threads of one process with "
         "the NVLink expert exchange (test_gpu sets it)"},
    };
    return vars;
}

std::optional<std::string> env_value(std::string_view name) {
    bool known = false;
    for (const EnvVar& v : env_vars()) known = known || name == v.name;
    ST_ASSERT(known, "environment variable ", name, " is read but not registered in core/env.cpp");
    const char* value = std::getenv(std::string(name).c_str());
    if (!value || !*value) return std::nullopt;
    return std::string(value);
}

}  // namespace sparsetron
