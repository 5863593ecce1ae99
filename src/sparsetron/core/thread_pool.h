// A small persistent thread pool for the CPU backend's hot loops.
//
// `parallel_for(n, fn)` splits [0, n) into contiguous chunks, one per worker; results must not
// depend on the chunking (each index is written by exactly one worker), so outputs are identical
// for any thread count. Threads: SPARSETRON_NUM_THREADS, else the hardware concurrency.
#pragma once

#include <cstdint>
#include <functional>

namespace sparsetron {

int num_threads();
void set_num_threads(int n);
void parallel_for(int64_t n, const std::function<void(int64_t begin, int64_t end)>& fn,
                  int64_t min_chunk = 1);

}  // namespace sparsetron
