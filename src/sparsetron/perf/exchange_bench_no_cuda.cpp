// A build without CUDA links this in place of perf/cuda/exchange_bench.cpp.
#include "sparsetron/core/error.h"
#include "sparsetron/perf/exchange_bench.h"

namespace sparsetron {

ExchangeBenchResult bench_expert_exchange(Comm&, const ExchangeBenchOptions&) {
    built_without_cuda("bench-exchange");
}

}  // namespace sparsetron
