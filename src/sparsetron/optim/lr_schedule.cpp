#include "sparsetron/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace sparsetron {

double learning_rate(const RunConfig& r, int64_t step) {
    if (r.lr_warmup_iters > 0 && step <= r.lr_warmup_iters)
        return r.lr * double(step) / double(r.lr_warmup_iters);
    if (r.lr_decay_style == "constant") return r.lr;
    const int64_t decay_end = r.lr_decay_iters > 0 ? r.lr_decay_iters : r.train_iters;
    const int64_t span = std::max<int64_t>(1, decay_end - r.lr_warmup_iters);
    const double progress = std::clamp(double(step - r.lr_warmup_iters) / double(span), 0.0, 1.0);
    double factor = 0;  // 1 at the start of decay, 0 at its end
    if (r.lr_decay_style == "cosine") {
        factor = 0.5 * (1.0 + std::cos(M_PI * progress));
    } else if (r.lr_decay_style == "linear") {
        factor = 1.0 - progress;
    } else {  // WSD: stable, then linear decay over the last fraction
        double start = 1.0 - r.lr_wsd_decay_fraction;
        factor = progress <= start ? 1.0 : 1.0 - (progress - start) / r.lr_wsd_decay_fraction;
    }
    return r.min_lr + (r.lr - r.min_lr) * factor;
}

}  // namespace sparsetron
