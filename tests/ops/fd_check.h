// Finite-difference checks of the CPU backwards in fp64 (DESIGN §4).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace sparsetron::test {

// Compares analytic d(loss)/d(x[i]) with (loss(x+h) - loss(x-h)) / 2h for every element of x.
inline void check_gradient(std::vector<double>& x, const std::vector<double>& analytic,
                           const std::function<double()>& loss, const char* what,
                           double tol = 1e-7) {
    ASSERT_EQ(x.size(), analytic.size());
    const double h = 1e-5;
    for (size_t i = 0; i < x.size(); ++i) {
        double keep = x[i];
        x[i] = keep + h;
        double up = loss();
        x[i] = keep - h;
        double down = loss();
        x[i] = keep;
        double fd = (up - down) / (2 * h);
        double err = std::fabs(fd - analytic[i]) / std::max(1.0, std::fabs(fd));
        EXPECT_LT(err, tol) << what << "[" << i << "]: analytic " << analytic[i] << " fd " << fd;
    }
    double largest = 0;
    for (double a : analytic) largest = std::max(largest, std::fabs(a));
    EXPECT_GT(largest, 1e-6) << what << ": an all-zero gradient would make this check vacuous";
}

inline double weighted_sum(const std::vector<double>& y, const std::vector<double>& w) {
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
    return s;
}

}  // namespace sparsetron::test
