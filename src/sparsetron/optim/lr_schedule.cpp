#include "sparsetron/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace sparsetron {

double learning_rate(const RunConfig& r, int64_t update) {
    const double n = double(update - 1);  // the scheduler's steps: the updates already applied
    const double warmup = double(r.lr_warmup_iters);
    const double max_lr = r.lr, min_lr = r.min_lr;
    if (warmup > 0 && n <= warmup)
        return r.lr_warmup_init + (max_lr - r.lr_warmup_init) * n / warmup;
    if (r.lr_decay_style == "constant") return max_lr;
    const double decay = double(r.lr_decay_iters > 0 ? r.lr_decay_iters : r.train_iters);
    if (n > decay) return min_lr;
    if (r.lr_decay_style == "inverse-square-root")
        return std::max(min_lr,
                        max_lr * std::sqrt(std::max(warmup, 1.0)) / std::sqrt(std::max(n, 1.0)));
    const double ratio = (n - warmup) / (decay - warmup);
    double coeff = 0;  // 1 at the start of the decay, 0 at its end
    if (r.lr_decay_style == "linear") {
        coeff = 1.0 - ratio;
    } else if (r.lr_decay_style == "cosine") {
        coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0);
    } else {  // WSD: constant, then the anneal over the last lr_wsd_decay_iters
        const double anneal_start = decay - double(r.lr_wsd_decay_iters);
        if (n <= anneal_start) {
            coeff = 1.0;
        } else {
            const double x = (n - anneal_start) / double(r.lr_wsd_decay_iters);
            if (r.lr_wsd_decay_style == "linear")
                coeff = 1.0 - x;
            else if (r.lr_wsd_decay_style == "cosine")
                coeff = 0.5 * (std::cos(M_PI * x) + 1.0);
            else if (r.lr_wsd_decay_style == "minus_sqrt")
                coeff = 1.0 - std::sqrt(x);
            else  // exponential
                coeff = 2.0 * std::pow(0.5, x) - 1.0;
        }
    }
    return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace sparsetron
