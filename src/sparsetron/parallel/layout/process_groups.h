// Every communicator a layout needs, made once from the world communicator by split (SPEC §10:
// "communicators created once"; dynamic CP's power-of-two sub-groups included), so nothing in a
// step creates a communicator.
#pragma once

#include <map>
#include <memory>

#include "sparsetron/parallel/comm/comm.h"
#include "sparsetron/parallel/layout/layout.h"

namespace sparsetron {

struct ProcessGroups {
    ParallelLayout layout;
    std::unique_ptr<Comm> cp, dp, ep, edp;
    // Pipeline parallelism (null without it): this stage's ranks, this rank's pipeline (one
    // rank per stage) and its embedding pair (the first and last stages' ranks).
    std::unique_ptr<Comm> stage, pp, embedding;
    // Dynamic CP: one communicator per power-of-two size (min_dynamic_cp .. the stage's ranks),
    // this rank's aligned block of that size.
    std::map<int, std::unique_ptr<Comm>> dynamic_cp;

    // Collective over `world` (every rank calls it with the same layout).
    static ProcessGroups create(Comm& world, const ParallelLayout& layout, int min_dynamic_cp = 1);
    Comm& dynamic(int size) const;  // throws for a size that was not made
};

}  // namespace sparsetron
