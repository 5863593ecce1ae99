// Grouped expert GEMM on Hopper's warpgroup MMA (wgmma, sm_90a): whether the device has it, the
// engine's choice among the warp-specialized persistent kernel's configurations
// (grouped_gemm_ws.cu; tiles, operand layouts and each kind's roles: wgmma.cuh), and those
// configurations for the perf harness. The blocked two-blocks-per-SM kernels that this file held
// (530 / 454 / 463 TFLOP/s for x W^T / dy W / weight gradient at the proxy's shape,
// docs/perf/2026-11-30-wgmma-grouped-gemm.md) were removed once the warp-specialized kernel ran at
// 901 / 869 / 686 (docs/perf/2026-12-01-grouped-gemm-tma.md).
#include <string>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"

namespace sparsetron::cuda {

bool grouped_gemm_wgmma_available() {
    static const bool hopper = [] {
        int device = 0, major = 0, minor = 0;
        ST_CUDA_CHECK(cudaGetDevice(&device));
        ST_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        ST_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        return major == 9 && minor == 0;
    }();
    return hopper;
}

namespace {
// SPARSETRON_GROUPED_GEMM picks another configuration than the engine's for every kind, to measure
// it against the engine's in one process: "waits" the cp.async feed, "tma" TMA without the
// multicast, "pair" TMA with B multicast but without the bulk tensor stores, "stores" the bulk
// tensor stores of the bf16 outputs but the weight gradient's fp32 adds by the consumers'
// red.global (grouped_gemm_ws.cu's configurations 0, 2, 4 and 6; the engine's is 8).
int forced_config() {
    static const int config = [] {
        if (env_is("SPARSETRON_GROUPED_GEMM", "waits")) return 0;
        if (env_is("SPARSETRON_GROUPED_GEMM", "tma")) return 2;
        if (env_is("SPARSETRON_GROUPED_GEMM", "pair")) return 4;
        if (env_is("SPARSETRON_GROUPED_GEMM", "stores")) return 6;
        return -1;
    }();
    return config;
}
}  // namespace

void grouped_gemm_wgmma(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets,
                        int64_t experts, int64_t max_rows, int64_t row_capacity, int64_t n,
                        int64_t k, const bf16* a, const bf16* b, void* c, int64_t weight_stride,
                        bool accumulate) {
    // TMA loads, B multicast to clusters of two, bulk tensor stores of the bf16 outputs and bulk
    // tensor reduce-adds of the weight gradient's fp32 tiles (grouped_gemm_ws.cu's configuration
    // 8). Same call, 6f60da3: x W^T / dy W / weight gradient 900 / 862 / 735 TFLOP/s against 900 /
    // 862 / 695 with the consumers' red.global adds (configuration 6); 17533f2: 909 / 869 / 700
    // with the stores against 837 / 703 / 699 without them and 800 / 684 / 660 by TMA alone.
    const int forced = forced_config();
    grouped_gemm_ws(ctx, forced >= 0 ? forced : 8, kind, offsets, experts, max_rows, row_capacity,
                    n, k, a, b, c, weight_stride, accumulate);
}

int grouped_gemm_wgmma_configs() {
    return 1 + kGroupedGemmWsConfigs;
}

std::string grouped_gemm_wgmma_config(const ExecContext& ctx, int config, GroupedGemm kind,
                                      const int32_t* offsets, int64_t experts, int64_t max_rows,
                                      int64_t row_capacity, int64_t n, int64_t k, const bf16* a,
                                      const bf16* b, void* c, bool accumulate) {
    const int64_t ws = n * k;
    if (config == 0) {
        grouped_gemm_wgmma(ctx, kind, offsets, experts, max_rows, row_capacity, n, k, a, b, c, ws,
                           accumulate);
        return forced_config() < 0 ? "wgmma, the engine's choice (TMA, B multicast, TMA stores "
                                     "and reduce-adds)"
                                   : "wgmma, as SPARSETRON_GROUPED_GEMM sets";
    }
    const int blocks = grouped_gemm_ws(ctx, config - 1, kind, offsets, experts, max_rows,
                                       row_capacity, n, k, a, b, c, ws, accumulate);
    return std::string(grouped_gemm_ws_name(config - 1)) + ", " + std::to_string(blocks) +
           " blocks";
}

}  // namespace sparsetron::cuda
