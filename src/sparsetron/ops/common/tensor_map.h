// TMA tensor maps (Hopper's bulk tensor copies) for the kernels that load operand tiles with
// cp.async.bulk.tensor: built on the host per launch and passed by value as __grid_constant__
// kernel parameters, so a captured graph keeps them with its launches.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <initializer_list>

namespace sparsetron::cuda {

// A bf16 tensor of up to 5 dimensions, innermost first: `dims` elements each, `strides` the
// bytes between consecutive indices of dimensions 1.. (dimension 0 is contiguous; multiples of
// 16). Boxes of `box` elements land in shared memory 128-byte swizzled (a box's inner extent is
// 64 elements, one 128-byte row; wgmma.cuh's tile layouts); elements outside `dims` read as zero.
CUtensorMap bf16_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                            std::initializer_list<int64_t> strides,
                            std::initializer_list<uint32_t> box);
// The same over fp32 elements (a 128-byte row is 32 of them): for bulk tensor reduce-adds into
// fp32 gradients.
CUtensorMap f32_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                           std::initializer_list<int64_t> strides,
                           std::initializer_list<uint32_t> box);
// fp32 boxes landing unswizzled, rows packed (a box's inner extent times 4 bytes a multiple of 16):
// per-row scales the FP8 grouped GEMM stages beside its operand tiles.
CUtensorMap f32_unswizzled_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                                      std::initializer_list<int64_t> strides,
                                      std::initializer_list<uint32_t> box);
// The same as bf16_tensor_map over bytes (a 128-byte row is 128 of them): e4m3 operands of the FP8
// grouped GEMM.
CUtensorMap u8_tensor_map(const void* base, std::initializer_list<int64_t> dims,
                          std::initializer_list<int64_t> strides,
                          std::initializer_list<uint32_t> box);

}  // namespace sparsetron::cuda
