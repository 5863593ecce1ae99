#include "sparsetron/model/cuda/activation_offload.h"

#include <algorithm>

#include "sparsetron/core/error.h"

namespace sparsetron::cuda {

ActivationOffload::ActivationOffload(MemoryPlan& plan, std::vector<std::string> names)
    : plan_(plan) {
    for (std::string& n : names) groups_.push_back(Group{std::move(n), {}, 0, -1});
}

void ActivationOffload::add(int64_t g, const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, void** ptr) {
    ST_ASSERT(g >= 0 && g < applications(), "activation offload: buffer '", name,
              "' of no layer application");
    ST_ASSERT(regions_[0] < 0, "activation offload: buffer '", name, "' added after plan()");
    size_t bytes = dtype_size(dtype);
    for (const int64_t s : shape) bytes *= size_t(s);
    Group& G = groups_[size_t(g)];
    const size_t at =
        (G.bytes + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment;
    G.buffers.push_back(Buffer{at, ptr});
    G.bytes = at + bytes;
}

void ActivationOffload::plan() {
    for (const Group& G : groups_) region_bytes_ = std::max(region_bytes_, G.bytes);
    if (region_bytes_ == 0) return;
    const auto u8 = [](size_t n) { return std::vector<int64_t>{int64_t(n)}; };
    for (int r = 0; r < 2; ++r)
        regions_[r] = plan_.add(MemClass::Activations, cat("offload.device_region.", r), DType::U8,
                                u8(region_bytes_));
    for (int64_t g = 0; g < applications(); ++g) {
        Group& G = groups_[size_t(g)];
        if (offloaded(g) && G.bytes > 0)
            G.host = plan_.add(MemClass::HostOffload, "offload." + G.name, DType::U8, u8(G.bytes));
    }
}

void ActivationOffload::bind(const ExecContext& ctx) {
    if (region_bytes_ == 0) return;
    for (int r = 0; r < 2; ++r) region_[r] = static_cast<char*>(plan_.view(regions_[r]).data);
    host_.assign(groups_.size(), nullptr);
    for (size_t g = 0; g < groups_.size(); ++g) {
        const Group& G = groups_[g];
        for (const Buffer& b : G.buffers) *b.ptr = region_[g % 2] + b.offset;
        if (G.host >= 0) host_[g] = static_cast<char*>(plan_.view(G.host).data);
    }
    copies_ = std::make_unique<cuda::OffloadCopies>(ctx, applications());
}

void ActivationOffload::before_forward(int64_t g) {
    // Application g - 2 used this region: its copy out must have read it.
    if (copies_ && g >= 2 && groups_[size_t(g - 2)].host >= 0) copies_->wait_out(g - 2);
}

void ActivationOffload::after_forward(int64_t g) {
    const Group& G = groups_[size_t(g)];
    if (copies_ && G.host >= 0) copies_->copy_out(g, host_[size_t(g)], region_[g % 2], G.bytes);
}

void ActivationOffload::before_backward(int64_t g) {
    if (copies_ && groups_[size_t(g)].host >= 0) copies_->wait_in(g);
}

void ActivationOffload::after_backward(int64_t g) {
    // The region g used is free: application g - 2's buffers come back into it.
    if (g < 2 || !copies_) return;
    const Group& G = groups_[size_t(g - 2)];
    if (G.host >= 0) copies_->copy_in(g - 2, region_[g % 2], host_[size_t(g - 2)], G.bytes);
}

}  // namespace sparsetron::cuda
