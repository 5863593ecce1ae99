// bf16_tensor_map: cuTensorMapEncodeTiled through the runtime's driver entry point, so the engine
// needs no link against libcuda (the device machine has the driver, not its -dev files).
#include <cudaTypedefs.h>

#include "sparsetron/core/cuda_check.h"
#include "sparsetron/core/error.h"
#include "sparsetron/ops/common/tensor_map.h"

namespace sparsetron::cuda {

namespace {
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found{};
        ST_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                       cudaEnableDefault, &found));
        ST_CHECK(found == cudaDriverEntryPointSuccess && p,
                 "CUDA driver: cuTensorMapEncodeTiled not found (needs a CUDA 12+ driver)");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }();
    return fn;
}

CUtensorMap tensor_map(CUtensorMapDataType type, const char* name, const void* base,
                       std::initializer_list<int64_t> dims, std::initializer_list<int64_t> strides,
                       std::initializer_list<uint32_t> box,
                       CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
    const uint32_t rank = uint32_t(dims.size());
    ST_CHECK(rank >= 1 && rank <= 5 && strides.size() == rank - 1 && box.size() == rank, name, ": ",
             rank, " dimensions, ", strides.size(), " strides, ", box.size(), " box extents");
    cuuint64_t d[5], s[4];
    cuuint32_t b[5], unit[5];
    uint32_t i = 0;
    for (int64_t v : dims) d[i++] = cuuint64_t(v);
    i = 0;
    for (int64_t v : strides) s[i++] = cuuint64_t(v);
    i = 0;
    for (uint32_t v : box) unit[i] = 1, b[i++] = v;
    CUtensorMap map;
    const CUresult r = encode_tiled()(
        &map, type, rank, const_cast<void*>(base), d, s, b, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    ST_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", int(r), ") for a ",
             rank, "-d ", name, " at ", base, ", inner extent ", d[0], ", box ", b[0], " x ",
             rank > 1 ? b[1] : 1u);
    return map;
}

}  // namespace

CUtensorMap bf16_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                            std::initializer_list<int64_t> strides,
                            std::initializer_list<uint32_t> box) {
    return tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, "bf16_tensor_map", base, dims, strides,
                      box);
}

CUtensorMap f32_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                           std::initializer_list<int64_t> strides,
                           std::initializer_list<uint32_t> box) {
    return tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, "f32_tensor_map", base, dims, strides, box);
}

CUtensorMap f32_unswizzled_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                                      std::initializer_list<int64_t> strides,
                                      std::initializer_list<uint32_t> box) {
    return tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, "f32_unswizzled_tensor_map", base, dims,
                      strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
}

CUtensorMap u8_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                          std::initializer_list<int64_t> strides,
                          std::initializer_list<uint32_t> box) {
    return tensor_map(CU_TENSOR_MAP_DATA_TYPE_UINT8, "u8_tensor_map", base, dims, strides, box);
}

}  // namespace sparsetron::cuda
