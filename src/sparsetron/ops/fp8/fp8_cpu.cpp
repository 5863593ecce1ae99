#include "sparsetron/ops/fp8/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "sparsetron/core/thread_pool.h"

namespace sparsetron::cpu {

namespace {

// The 127 non-negative finite and NaN codes' values, increasing with the code (0x7F is NaN).
const std::array<float, 128>& e4m3_table() {
    static const std::array<float, 128> table = [] {
        std::array<float, 128> t{};
        for (int c = 0; c < 128; ++c) {
            const int e = c >> 3, m = c & 7;
            t[size_t(c)] = e == 0 ? std::ldexp(float(m), -9)  // subnormal: m x 2^-9
                                  : std::ldexp(1.f + float(m) / 8.f, e - 7);
        }
        t[127] = std::numeric_limits<float>::quiet_NaN();
        return t;
    }();
    return table;
}

int64_t blocks(int64_t n) {
    return (n + kFp8Block - 1) / kFp8Block;
}

}  // namespace

float e4m3_to_float(uint8_t code) {
    const float v = e4m3_table()[code & 0x7F];
    return (code & 0x80) ? -v : v;
}

uint8_t e4m3_from_float(float x) {
    if (std::isnan(x)) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const float a = std::fabs(x);
    if (a >= kE4m3Max) return sign | 0x7E;  // 448, saturating
    // The grid around a: spacing 2^(E-3) in the binade [2^E, 2^(E+1)), 2^-9 below 2^-6.
    int e = 0;
    std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): E = e - 1
    const int E = std::max(e - 1, -6);
    const float step = std::ldexp(1.f, E - 3);
    const float v = std::nearbyint(a / step) * step;  // round half to even (exact division)
    const auto& t = e4m3_table();
    const auto it = std::lower_bound(t.begin(), t.begin() + 127, v);
    return sign | uint8_t(it - t.begin());
}

float fp8_scale_from_amax(float amax, bool pow2) {
    if (!(amax > 0.f) || !std::isfinite(amax)) return 1.f;
    float scale = kE4m3Max / amax;
    if (!std::isfinite(scale)) scale = std::numeric_limits<float>::max();
    if (pow2) {
        int e = 0;
        std::frexp(scale, &e);
        scale = std::ldexp(1.f, e - 1);  // 2^floor(log2(scale))
    }
    return scale;
}

void quantize_1x128(const float* x, int64_t rows, int64_t cols, int64_t ld, bool pow2, uint8_t* q,
                    float* scale_inv) {
    const int64_t nb = blocks(cols);
    parallel_for(
        rows,
        [&](int64_t rb, int64_t re) {
            for (int64_t r = rb; r < re; ++r)
                for (int64_t b = 0; b < nb; ++b) {
                    const int64_t c0 = b * kFp8Block, c1 = std::min(cols, c0 + kFp8Block);
                    float amax = 0.f;
                    for (int64_t c = c0; c < c1; ++c)
                        amax = std::max(amax, std::fabs(x[r * ld + c]));
                    const float s = fp8_scale_from_amax(amax, pow2);
                    for (int64_t c = c0; c < c1; ++c)
                        q[r * cols + c] = e4m3_from_float(x[r * ld + c] * s);
                    scale_inv[r * nb + b] = 1.f / s;
                }
        },
        8);
}

void quantize_128x128(const float* w, int64_t rows, int64_t cols, bool pow2, uint8_t* q,
                      float* scale_inv) {
    const int64_t rb_n = blocks(rows), cb_n = blocks(cols);
    parallel_for(
        rb_n * cb_n,
        [&](int64_t ib, int64_t ie) {
            for (int64_t i = ib; i < ie; ++i) {
                const int64_t br = i / cb_n, bc = i % cb_n;
                const int64_t r0 = br * kFp8Block, r1 = std::min(rows, r0 + kFp8Block);
                const int64_t c0 = bc * kFp8Block, c1 = std::min(cols, c0 + kFp8Block);
                float amax = 0.f;
                for (int64_t r = r0; r < r1; ++r)
                    for (int64_t c = c0; c < c1; ++c)
                        amax = std::max(amax, std::fabs(w[r * cols + c]));
                const float s = fp8_scale_from_amax(amax, pow2);
                for (int64_t r = r0; r < r1; ++r)
                    for (int64_t c = c0; c < c1; ++c)
                        q[r * cols + c] = e4m3_from_float(w[r * cols + c] * s);
                scale_inv[br * cb_n + bc] = 1.f / s;
            }
        },
        1);
}

void gemm_fp8_blockwise(const uint8_t* qx, const float* sx, const uint8_t* qw, const float* sw,
                        int64_t m, int64_t n, int64_t k, float* y, bool w_1x128) {
    const int64_t kb_n = blocks(k);
    parallel_for(
        m,
        [&](int64_t rb, int64_t re) {
            for (int64_t i = rb; i < re; ++i)
                for (int64_t j = 0; j < n; ++j) {
                    double acc = 0;
                    for (int64_t kb = 0; kb < kb_n; ++kb) {
                        const int64_t k0 = kb * kFp8Block, k1 = std::min(k, k0 + kFp8Block);
                        double part = 0;
                        for (int64_t c = k0; c < k1; ++c)
                            part += double(e4m3_to_float(qx[i * k + c])) *
                                    double(e4m3_to_float(qw[j * k + c]));
                        const int64_t wr = w_1x128 ? j : j / kFp8Block;
                        acc += part * double(sx[i * kb_n + kb]) * double(sw[wr * kb_n + kb]);
                    }
                    y[i * n + j] = float(acc);
                }
        },
        4);
}

}  // namespace sparsetron::cpu
