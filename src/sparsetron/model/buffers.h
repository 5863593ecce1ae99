// Declaring a module's buffers into the memory plan and resolving them after allocation.
//
// Activations are declared per use site (a layer applied several times, like the repeated MTP
// layer, declares one set per application). Backward scratch is shared: `scratch()` returns the
// same slot for the same name, so every layer of a kind reuses one buffer.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "sparsetron/core/error.h"
#include "sparsetron/core/memory_plan.h"

namespace sparsetron {

class Buffers {
  public:
    Buffers(MemoryPlan& plan, DType dtype) : plan_(plan), dtype_(dtype) {}

    MemoryPlan::Slot act(const std::string& name, std::vector<int64_t> shape) {
        return plan_.add(MemClass::Activations, name, dtype_, std::move(shape));
    }
    MemoryPlan::Slot act_i32(const std::string& name, std::vector<int64_t> shape) {
        return plan_.add(MemClass::Activations, name, DType::I32, std::move(shape));
    }
    MemoryPlan::Slot scratch(const std::string& name, std::vector<int64_t> shape) {
        return scratch_typed(name, std::move(shape), dtype_);
    }
    MemoryPlan::Slot scratch_i32(const std::string& name, std::vector<int64_t> shape) {
        return scratch_typed(name, std::move(shape), DType::I32);
    }
    MemoryPlan::Slot scratch_typed(const std::string& name, std::vector<int64_t> shape, DType dt) {
        auto it = scratch_.find(name);
        if (it != scratch_.end()) {
            const PlanEntry& e = plan_.entries()[it->second];
            ST_ASSERT(e.shape == shape && e.dtype == dt, "scratch '", name,
                      "' redeclared with another shape");
            return it->second;
        }
        return scratch_[name] = plan_.add(MemClass::Workspace, name, dt, std::move(shape));
    }

    template <typename T>
    T* ptr(MemoryPlan::Slot s) const {
        return plan_.view(s).template ptr<T>();
    }
    MemoryPlan& plan() { return plan_; }
    DType dtype() const { return dtype_; }

  private:
    MemoryPlan& plan_;
    DType dtype_;
    std::map<std::string, MemoryPlan::Slot> scratch_;
};

}  // namespace sparsetron
