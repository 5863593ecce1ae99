// Where cuBLASLt's block-scaled FP8 GEMM (Hopper: scale modes VEC128_32F and BLK128x128_32F)
// reads the scale of each block of an operand [rows, k] stored with k contiguous (Transformer
// Engine's layout for the same GEMMs): 1x128 blocks as [ceil(k / 128), roundup(rows, 4)], rows
// contiguous; 128x128 blocks as [ceil(rows / 128), roundup(ceil(k / 128), 4)]. The padding
// entries are never read. Shared by the CUDA quantizers and the tests (plain constexpr).
#pragma once

#include <cstdint>

namespace sparsetron::fp8 {

constexpr int64_t kBlock = 128;

constexpr int64_t blocks(int64_t n) {
    return (n + kBlock - 1) / kBlock;
}
constexpr int64_t round4(int64_t n) {
    return (n + 3) / 4 * 4;
}

// 1x128: the scale of row r's block kb (columns [128 kb, 128 kb + 128)).
constexpr int64_t scale_index_1x128(int64_t r, int64_t kb, int64_t rows) {
    return kb * round4(rows) + r;
}
constexpr int64_t scales_1x128(int64_t rows, int64_t k) {
    return blocks(k) * round4(rows);
}

// 128x128: the scale of block (rb, kb).
constexpr int64_t scale_index_128x128(int64_t rb, int64_t kb, int64_t k) {
    return rb * round4(blocks(k)) + kb;
}
constexpr int64_t scales_128x128(int64_t rows, int64_t k) {
    return blocks(rows) * round4(blocks(k));
}

// The padded row count of the experts' weight-gradient operands (quantize_fp8_1x128_expert_columns)
// for `rows` rows over `experts` experts: every segment rounded up to 128 rows.
constexpr int64_t expert_columns_padded(int64_t rows, int64_t experts) {
    return (rows + experts * (kBlock - 1) + kBlock - 1) / kBlock * kBlock;
}

}  // namespace sparsetron::fp8
