#include "sparsetron/core/memory_plan.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <map>
#include <new>
#include <sstream>

#include "sparsetron/core/device_memory.h"

namespace sparsetron {

const char* mem_class_name(MemClass c) {
    switch (c) {
        case MemClass::Parameters:
            return "parameters";
        case MemClass::Gradients:
            return "gradients";
        case MemClass::OptimizerState:
            return "optimizer state";
        case MemClass::Activations:
            return "activations";
        case MemClass::Workspace:
            return "workspace";
        case MemClass::HostOffload:
            return "offloaded (host)";
    }
    return "?";
}

Arena::Arena(Device device, size_t bytes, bool pinned_host)
    : bytes_(bytes), device_(pinned_host ? Device::CPU : device), pinned_(pinned_host) {
    if (bytes == 0) return;
    if (pinned_) {
        data_ = static_cast<char*>(pinned_host_alloc(bytes));
    } else if (device == Device::CPU) {
        size_t rounded =
            (bytes + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment;
        data_ = static_cast<char*>(std::aligned_alloc(MemoryPlan::kAlignment, rounded));
        if (!data_) throw Error(cat("out of host memory allocating ", format_bytes(bytes)));
        std::memset(data_, 0, rounded);
    } else {
        data_ = static_cast<char*>(device_alloc(bytes));
    }
}

Arena::~Arena() {
    release();
}

Arena::Arena(Arena&& o) noexcept
    : data_(o.data_), bytes_(o.bytes_), device_(o.device_), pinned_(o.pinned_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
}

Arena& Arena::operator=(Arena&& o) noexcept {
    if (this != &o) {
        release();
        data_ = o.data_, bytes_ = o.bytes_, device_ = o.device_, pinned_ = o.pinned_;
        o.data_ = nullptr, o.bytes_ = 0;
    }
    return *this;
}

void Arena::release() {
    if (!data_) return;
    if (pinned_) {
        pinned_host_free(data_);
    } else if (device_ == Device::CPU) {
        std::free(data_);
    } else {
        device_free(data_);
    }
    data_ = nullptr;
}

namespace {

size_t aligned(size_t bytes) {
    return (bytes + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment;
}

}  // namespace

MemoryPlan::Slot MemoryPlan::push(PlanEntry e, size_t n) {
    ST_ASSERT(!allocated_, "plan entry '", e.name, "' added after allocation");
    ST_ASSERT(!e.shape.empty() && e.shape.size() <= kMaxDims, "rank of ", e.name);
    for (int64_t s : e.shape) {
        ST_CHECK(s > 0, "memory plan: buffer '", e.name, "' has a zero or negative dimension");
        n *= static_cast<size_t>(s);
    }
    e.bytes = n * dtype_size(e.dtype);
    const int c = static_cast<int>(e.cls);
    size_t& used = e.phase.empty() ? plain_bytes_[c] : phase_bytes_[c][e.phase];
    e.offset = aligned(used);
    used = e.offset + e.bytes;
    entries_.push_back(std::move(e));
    return static_cast<Slot>(entries_.size() - 1);
}

MemoryPlan::Slot MemoryPlan::add(MemClass cls, std::string name, DType dtype,
                                 std::vector<int64_t> shape) {
    PlanEntry e;
    e.name = std::move(name), e.cls = cls, e.dtype = dtype, e.shape = std::move(shape);
    return push(std::move(e), 1);
}

MemoryPlan::Slot MemoryPlan::add_in_phase(MemClass cls, std::string phase, std::string name,
                                          DType dtype, std::vector<int64_t> shape) {
    ST_ASSERT(!phase.empty(), "plan entry '", name, "': an empty phase name");
    PlanEntry e;
    e.name = std::move(name), e.cls = cls, e.dtype = dtype, e.shape = std::move(shape);
    e.phase = std::move(phase);
    return push(std::move(e), 1);
}

size_t MemoryPlan::phase_area_offset(MemClass cls) const {
    return aligned(plain_bytes_[static_cast<int>(cls)]);
}

size_t MemoryPlan::class_bytes(MemClass cls) const {
    const auto& phases = phase_bytes_[static_cast<int>(cls)];
    if (phases.empty()) return plain_bytes_[static_cast<int>(cls)];
    size_t largest = 0;
    for (const auto& [name, bytes] : phases) largest = std::max(largest, bytes);
    return phase_area_offset(cls) + largest;
}

size_t MemoryPlan::total_bytes() const {
    size_t t = 0;
    for (int c = 0; c < kNumMemClasses; ++c)
        if (MemClass(c) != MemClass::HostOffload) t += class_bytes(MemClass(c));
    return t;
}

void MemoryPlan::allocate(Device device) {
    ST_ASSERT(!allocated_, "plan allocated twice");
    for (int c = 0; c < kNumMemClasses; ++c)
        arenas_[c] = Arena(device, class_bytes(MemClass(c)),
                           MemClass(c) == MemClass::HostOffload && device == Device::CUDA);
    device_ = device;
    allocated_ = true;
}

void MemoryPlan::allocate_only(Device device, const std::vector<MemClass>& classes) {
    ST_ASSERT(!allocated_, "plan allocated twice");
    for (MemClass c : classes) arenas_[static_cast<int>(c)] = Arena(device, class_bytes(c));
    device_ = device;
    allocated_ = true;
}

char* MemoryPlan::class_base(MemClass cls) const {
    ST_ASSERT(allocated_, "plan not allocated");
    char* base = arenas_[static_cast<int>(cls)].data();
    ST_ASSERT(base || class_bytes(cls) == 0, "memory class ", mem_class_name(cls),
              " was not allocated in this plan");
    return base;
}

Tensor MemoryPlan::view(Slot slot) const {
    ST_ASSERT(allocated_, "view before allocation");
    ST_ASSERT(slot >= 0 && static_cast<size_t>(slot) < entries_.size(), "slot ", slot);
    const PlanEntry& e = entries_[slot];
    Tensor t;
    t.data = class_base(e.cls) + e.offset + (e.phase.empty() ? 0 : phase_area_offset(e.cls));
    t.dtype = e.dtype;
    t.device = e.cls == MemClass::HostOffload ? Device::CPU : device_;
    t.ndim = static_cast<int>(e.shape.size());
    int64_t st = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
        t.shape[d] = e.shape[d];
        t.stride[d] = st;
        st *= e.shape[d];
    }
    return t;
}

std::string format_bytes(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 4) bytes /= 1024.0, ++u;
    std::ostringstream os;
    os << std::fixed << std::setprecision(u == 0 ? 0 : 2) << bytes << " " << units[u];
    return os.str();
}

std::string MemoryPlan::format(int top) const {
    std::ostringstream os;
    for (int c = 0; c < kNumMemClasses; ++c) {
        auto cls = static_cast<MemClass>(c);
        std::vector<const PlanEntry*> es;
        for (const auto& e : entries_)
            if (e.cls == cls) es.push_back(&e);
        os << std::left << std::setw(18) << mem_class_name(cls) << std::right << std::setw(14)
           << format_bytes(static_cast<double>(class_bytes(cls))) << "  (" << es.size()
           << " buffers)\n";
        const auto& phases = phase_bytes(cls);
        if (!phases.empty()) {
            os << "    phases, one live at a time in one area of "
               << format_bytes(double(class_bytes(cls) - phase_area_offset(cls))) << ":";
            for (const auto& [name, bytes] : phases)
                os << " " << name << " " << format_bytes(double(bytes)) << ";";
            os << "\n";
        }
        std::stable_sort(es.begin(), es.end(), [](const PlanEntry* a, const PlanEntry* b) {
            return a->bytes > b->bytes;
        });
        for (int i = 0; i < static_cast<int>(es.size()) && i < top; ++i) {
            std::ostringstream shape;
            for (size_t d = 0; d < es[i]->shape.size(); ++d)
                shape << (d ? "x" : "") << es[i]->shape[d];
            os << "    " << std::left << std::setw(52) << es[i]->name << std::setw(6)
               << dtype_name(es[i]->dtype) << std::setw(20) << shape.str() << std::right
               << std::setw(12) << format_bytes(static_cast<double>(es[i]->bytes))
               << (es[i]->phase.empty() ? "" : "  (" + es[i]->phase + ")") << "\n";
        }
        if (static_cast<int>(es.size()) > top) os << "    ... " << es.size() - top << " more\n";
    }
    os << std::left << std::setw(18) << "total" << std::right << std::setw(14)
       << format_bytes(static_cast<double>(total_bytes())) << "\n";
    if (host_offload_bytes() > 0)
        os << std::left << std::setw(18) << "host (offload)" << std::right << std::setw(14)
           << format_bytes(static_cast<double>(host_offload_bytes())) << "\n";
    return os.str();
}

namespace {

// "model.layers.12.mlp.experts.3.up_proj.weight" -> "model.layers.*.mlp.experts.*.up_proj.weight"
std::string kind_pattern(const std::string& name) {
    std::string out;
    size_t begin = 0;
    while (begin <= name.size()) {
        size_t end = name.find('.', begin);
        if (end == std::string::npos) end = name.size();
        const std::string part = name.substr(begin, end - begin);
        const bool digits =
            !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
        out += digits ? "*" : part;
        if (end < name.size()) out += '.';
        begin = end + 1;
    }
    return out;
}

}  // namespace

std::vector<MemoryPlan::Kind> MemoryPlan::kinds() const {
    std::map<std::pair<int, std::string>, Kind> by;
    for (const auto& e : entries_) {
        Kind& k = by[{static_cast<int>(e.cls), kind_pattern(e.name)}];
        if (k.count == 0) k.pattern = kind_pattern(e.name), k.cls = e.cls;
        ++k.count;
        k.bytes += e.bytes;
    }
    std::vector<Kind> out;
    for (auto& [key, k] : by) out.push_back(std::move(k));
    std::stable_sort(out.begin(), out.end(),
                     [](const Kind& a, const Kind& b) { return a.bytes > b.bytes; });
    return out;
}

std::string MemoryPlan::format_kinds(int top) const {
    std::ostringstream os;
    const auto ks = kinds();
    for (int i = 0; i < static_cast<int>(ks.size()) && i < top; ++i) {
        const Kind& k = ks[size_t(i)];
        std::ostringstream each;
        each << k.count << " x " << format_bytes(double(k.bytes) / double(k.count));
        os << "    " << std::left << std::setw(52) << k.pattern << std::setw(18)
           << mem_class_name(k.cls) << std::setw(20) << each.str() << std::right << std::setw(12)
           << format_bytes(static_cast<double>(k.bytes)) << "\n";
    }
    return os.str();
}

}  // namespace sparsetron
