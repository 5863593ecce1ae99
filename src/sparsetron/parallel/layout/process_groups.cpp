#include "sparsetron/parallel/layout/process_groups.h"

#include "sparsetron/core/error.h"

namespace sparsetron {

ProcessGroups ProcessGroups::create(Comm& world, const ParallelLayout& layout, int min_dynamic_cp) {
    ST_CHECK(world.size() == layout.world, "process groups: a layout of ", layout.world,
             " ranks on a communicator of ", world.size());
    const int me = world.rank();
    ProcessGroups g;
    g.layout = layout;
    // Key = world rank: each group's ranks keep the world order (the layout's member lists).
    g.cp = world.split(layout.cp_color(me), me);
    g.dp = world.split(layout.dp_color(me), me);
    g.ep = world.split(layout.ep_color(me), me);
    g.edp = world.split(layout.edp_color(me), me);
    if (layout.pp > 1) {
        g.stage = world.split(layout.stage_color(me), me);
        g.pp = world.split(layout.pp_color(me), me);
        g.embedding = world.split(layout.embedding_color(me), me);
    }
    for (int size : layout.dynamic_cp_sizes(min_dynamic_cp))
        g.dynamic_cp[size] = world.split(layout.dynamic_cp_color(me, size), me);
    return g;
}

Comm& ProcessGroups::dynamic(int size) const {
    auto it = dynamic_cp.find(size);
    ST_CHECK(it != dynamic_cp.end(), "dynamic CP: no communicator of ", size,
             " ranks was made (sizes are powers of two from the minimum to the DP x CP ranks)");
    return *it->second;
}

}  // namespace sparsetron
