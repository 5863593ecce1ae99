// Element-wise and small ops: embedding lookup, RoPE, SwiGLU, adds and fills. CPU references:
// elementwise_cpu.cpp, rope_cpu.cpp; CUDA: elementwise.cu (SwiGLU can write the FP8 copy of its
// outputs for the routed experts, ops/fp8/fp8.h). Tests: tests/ops/test_elementwise.cpp,
// tests/gpu/ops/test_elementwise_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/ops/fp8/fp8.h"

namespace sparsetron::cpu {

template <typename T>
void embedding_forward(const int32_t* tokens, int64_t rows, const T* table, int64_t vocab,
                       int64_t dim, T* out);
template <typename T>
void embedding_backward(const int32_t* tokens, int64_t rows, const T* dout, int64_t vocab,
                        int64_t dim, T* dtable);

// Rotates pairs of x[t, h, 0:dim] (row stride ld_t, head stride ld_h) by position[t] * inv_freq.
// interleaved: pairs (2i, 2i+1); otherwise (i, i + dim/2). inverse: rotate by -angle (backward).
template <typename T>
void rope(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_t, int64_t ld_h,
          const int32_t* positions, double theta, bool interleaved, bool inverse);

template <typename T>
void swiglu_forward(const T* g, const T* u, int64_t n, T* out);
template <typename T>
void swiglu_backward(const T* g, const T* u, const T* dout, int64_t n, T* dg, T* du);

template <typename T>
void add_inplace(T* y, const T* x, int64_t n);  // y += x
template <typename T>
void scale_inplace(T* x, int64_t n, double s);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// A negative id gives a zero row (an MTP input past its document's end).
void embedding_forward(const ExecContext& ctx, const int32_t* tokens, int64_t rows,
                       const bf16* table, int64_t dim, bf16* out);
// dtable += scattered dout rows, negative ids skipped (fp32 atomics: the order of additions is
// not fixed).
void embedding_backward(const ExecContext& ctx, const int32_t* tokens, int64_t rows,
                        const bf16* dout, int64_t dim, float* dtable);

// In place, like cpu::rope (angles in fp64, so positions up to 2^24 keep their phase).
void rope(const ExecContext& ctx, bf16* x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_t,
          int64_t ld_h, const int32_t* positions, double theta, bool interleaved, bool inverse);

void swiglu_forward(const ExecContext& ctx, const bf16* g, const bf16* u, int64_t n, bf16* out);
void swiglu_backward(const ExecContext& ctx, const bf16* g, const bf16* u, const bf16* dout,
                     int64_t n, bf16* dg, bf16* du);
// The same over [rows, cols] with the FP8 copies of out (forward) and of dg and du (backward).
void swiglu_forward(const ExecContext& ctx, const bf16* g, const bf16* u, int64_t rows,
                    int64_t cols, bf16* out, const Fp8RowsOut& out8);
void swiglu_backward(const ExecContext& ctx, const bf16* g, const bf16* u, const bf16* dout,
                     int64_t rows, int64_t cols, bf16* dg, bf16* du, const Fp8RowsOut& dg8,
                     const Fp8RowsOut& du8);

void add_inplace(const ExecContext& ctx, bf16* y, const bf16* x, int64_t n);
void add_inplace(const ExecContext& ctx, float* y, const float* x, int64_t n);
void fill(const ExecContext& ctx, float* x, int64_t n, float value);

}  // namespace sparsetron::cuda
