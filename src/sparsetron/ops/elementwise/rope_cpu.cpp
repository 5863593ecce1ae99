// Rotary position embedding on a [T, H, dim] strided view (SPEC §2).
#include <cmath>
#include <vector>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/elementwise/elementwise.h"

namespace sparsetron::cpu {

template <typename T>
void rope(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_t, int64_t ld_h,
          const int32_t* positions, double theta, bool interleaved, bool inverse) {
    const int64_t half = dim / 2;
    std::vector<double> inv_freq(half);
    for (int64_t i = 0; i < half; ++i)
        inv_freq[i] = std::pow(theta, -2.0 * double(i) / double(dim));
    const double sign = inverse ? -1.0 : 1.0;
    parallel_for(
        tokens,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
                for (int64_t i = 0; i < half; ++i) {
                    double angle = double(positions[t]) * inv_freq[i];
                    double c = std::cos(angle), s = sign * std::sin(angle);
                    int64_t i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
                    for (int64_t h = 0; h < heads; ++h) {
                        T* p = x + t * ld_t + h * ld_h;
                        double a = p[i0], bb = p[i1];
                        p[i0] = static_cast<T>(a * c - bb * s);
                        p[i1] = static_cast<T>(a * s + bb * c);
                    }
                }
            }
        },
        4);
}

template void rope<float>(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const int32_t*,
                          double, bool, bool);
template void rope<double>(double*, int64_t, int64_t, int64_t, int64_t, int64_t, const int32_t*,
                           double, bool, bool);

}  // namespace sparsetron::cpu
