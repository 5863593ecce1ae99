// The static memory plan (DESIGN §1.1, §3).
//
// Every buffer the engine uses is declared here before the first step, with its memory class,
// name, dtype and shape. The plan is printable (`sparsetron plan`), its total is the peak-memory
// prediction, and `allocate()` makes exactly one allocation per class; afterwards `view(slot)`
// hands out the planned Tensor. Nothing is allocated inside a training step.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sparsetron/core/tensor.h"

namespace sparsetron {

// HostOffload: activations waiting for their backward in host memory (pinned when the plan is
// allocated for CUDA: activation offload's copies run on a side stream); not device memory.
enum class MemClass : uint8_t {
    Parameters,
    Gradients,
    OptimizerState,
    Activations,
    Workspace,
    HostOffload
};
constexpr int kNumMemClasses = 6;
const char* mem_class_name(MemClass c);

struct PlanEntry {
    std::string name;
    MemClass cls = MemClass::Workspace;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    size_t offset = 0;  // within its class's arena, or within its phase (below)
    size_t bytes = 0;
    // Empty, or the phase whose buffers it shares an area with (MemoryPlan::add_in_phase).
    std::string phase;
};

// One owning allocation (host memory, or device memory through the CUDA backend).
class Arena {
  public:
    Arena() = default;
    Arena(Device device, size_t bytes, bool pinned_host = false);
    ~Arena();
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    Arena(Arena&& other) noexcept;
    Arena& operator=(Arena&& other) noexcept;

    char* data() const { return data_; }
    size_t bytes() const { return bytes_; }
    Device device() const { return device_; }

  private:
    void release();
    char* data_ = nullptr;
    size_t bytes_ = 0;
    Device device_ = Device::CPU;
    bool pinned_ = false;  // CUDA pinned host memory (device_ is CPU)
};

class MemoryPlan {
  public:
    static constexpr size_t kAlignment = 256;

    using Slot = int32_t;

    // Declares a buffer; returns its slot. Only before allocate().
    Slot add(MemClass cls, std::string name, DType dtype, std::vector<int64_t> shape);
    // Declares a buffer of `phase`: the buffers of one phase are live together, those of two
    // phases never (each module's scratch, written and read only inside that module's forward or
    // backward). Every phase of a class starts at the same offset of one area after the class's
    // other buffers, so the area is as large as its largest phase.
    Slot add_in_phase(MemClass cls, std::string phase, std::string name, DType dtype,
                      std::vector<int64_t> shape);

    size_t class_bytes(MemClass cls) const;
    // The phases of a class with their bytes (empty where it has none).
    const std::map<std::string, size_t>& phase_bytes(MemClass cls) const {
        return phase_bytes_[static_cast<int>(cls)];
    }
    // The plan's bytes on its device (every class but HostOffload): the peak-memory prediction.
    size_t total_bytes() const;
    size_t host_offload_bytes() const { return class_bytes(MemClass::HostOffload); }
    const std::vector<PlanEntry>& entries() const { return entries_; }

    // One allocation per class on `device` (HostOffload in host memory, pinned for CUDA); the CPU
    // arenas are zero-filled.
    void allocate(Device device);
    // Only the listed classes (a host mirror of what a device run checkpoints: parameters and
    // optimizer state); views of the other classes' entries throw.
    void allocate_only(Device device, const std::vector<MemClass>& classes);
    bool allocated() const { return allocated_; }
    Device device() const { return device_; }

    Tensor view(Slot slot) const;
    char* class_base(MemClass cls) const;

    // Human-readable plan: per class, its largest entries and totals.
    std::string format(int top_entries_per_class = 6) const;
    // The buffers alike but for their layer or expert numbers, summed: at scale the plan is
    // dominated by a per-layer buffer no single copy of which stands out.
    struct Kind {
        std::string pattern;  // the name with every all-digit dotted component made '*'
        MemClass cls;
        int64_t count = 0;
        size_t bytes = 0;
    };
    std::vector<Kind> kinds() const;  // largest first
    // The `top` largest kinds, one line each ("layers.*.moe.x_received  activations  75 x ...").
    std::string format_kinds(int top = 8) const;

  private:
    Slot push(PlanEntry e, size_t elements);
    // Where a class's phase area starts: after its other buffers.
    size_t phase_area_offset(MemClass cls) const;
    std::vector<PlanEntry> entries_;
    size_t plain_bytes_[kNumMemClasses] = {};  // the buffers outside phases
    std::map<std::string, size_t> phase_bytes_[kNumMemClasses];
    Arena arenas_[kNumMemClasses];
    bool allocated_ = false;
    Device device_ = Device::CPU;
};

std::string format_bytes(double bytes);

}  // namespace sparsetron
