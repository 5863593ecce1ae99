#include "sparsetron/parallel/comm/launch_env.h"

#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"

namespace sparsetron {
namespace {

bool read_int(const char* name, int& out) {
    const std::optional<std::string> v = env_value(name);
    if (!v) return false;
    try {
        size_t used = 0;
        out = std::stoi(*v, &used);
        ST_CHECK(used == v->size(), "");
    } catch (const std::exception&) {
        throw Error(cat("launch environment: ", name, "='", *v, "' is not an integer"));
    }
    return true;
}

bool from(const char* rank, const char* world, const char* local, const char* launcher,
          LaunchEnv& env) {
    int r = 0, w = 0;
    const bool has_r = read_int(rank, r), has_w = read_int(world, w);
    if (!has_r && !has_w) return false;
    ST_CHECK(has_r && has_w, "launch environment: ", has_r ? world : rank, " is missing (",
             has_r ? rank : world, " is set)");
    ST_CHECK(w >= 1 && r >= 0 && r < w, "launch environment: ", rank, "=", r, " is not in [0, ",
             world, "=", w, ")");
    env.rank = r, env.world = w, env.launcher = launcher;
    env.local_rank = r;
    read_int(local, env.local_rank);
    return true;
}

}  // namespace

LaunchEnv detect_launch_env() {
    LaunchEnv env;
    if (from("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun",
             env))
        return env;
    if (from("RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun", env)) return env;
    if (from("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm", env)) return env;
    return env;
}

}  // namespace sparsetron
