// What the current device can run: the architecture predicate of the ops' dispatch functions.
#pragma once

namespace sparsetron::cuda {

// Whether the current device runs the sm_90a kernels (wgmma, TMA multicast, setmaxnreg): exactly
// compute capability 9.0, the only one the build's sm_90a code runs on.
bool has_sm90a();

}  // namespace sparsetron::cuda
