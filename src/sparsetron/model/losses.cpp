#include "sparsetron/model/losses.h"

#include <algorithm>

namespace sparsetron {

int64_t mtp_loss_slots(const ModelConfig& c) {
    return c.mtp_loss_type == "e2e_tv" ? std::min<int64_t>(c.mtp_num_layers, 1) : c.mtp_num_layers;
}

void add_mtp_rows(const ModelConfig& c, const MicroBatch& mb, std::vector<int64_t>& rows) {
    const int64_t D = c.mtp_num_layers;
    const bool tv = c.mtp_loss_type == "e2e_tv";
    for (int64_t d = 0; d < mb.num_documents; ++d) {
        const int64_t len = mb.cu_seqlens[d + 1] - mb.cu_seqlens[d];
        if (tv && D > 0) rows[0] += std::max<int64_t>(0, len - D);
        for (int64_t k = 1; !tv && k <= D; ++k) rows[k - 1] += std::max<int64_t>(0, len - k - 1);
    }
}

double reported_mtp_loss(const ModelConfig& c, const std::vector<double>& sums,
                         const std::vector<int64_t>& rows) {
    const double per_slot = c.mtp_loss_type == "e2e_tv"
                                ? c.mtp_loss_scaling_factor
                                : c.mtp_loss_scaling_factor / double(c.mtp_num_layers);
    double loss = 0;
    for (size_t k = 0; k < sums.size(); ++k)
        if (rows[k] > 0) loss += sums[k] * per_slot / double(rows[k]);
    return loss;
}

}  // namespace sparsetron
