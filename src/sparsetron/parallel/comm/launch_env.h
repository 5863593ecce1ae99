// Which process of a job this is, from the launcher's environment: mpirun (OMPI_COMM_WORLD_*),
// torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK), or SLURM (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID). No variables: a single process.
#pragma once

#include <string>

namespace sparsetron {

struct LaunchEnv {
    int rank = 0, world = 1, local_rank = 0;
    std::string launcher = "none";  // "mpirun" | "torchrun" | "slurm" | "none"
};

// Throws with the variable's name when a value is not a number or is inconsistent.
LaunchEnv detect_launch_env();

}  // namespace sparsetron
