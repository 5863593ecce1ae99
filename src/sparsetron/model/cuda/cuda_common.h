// Shared pieces of the CUDA model (built only with CUDA): planned device buffers resolved after
// allocation, parameter handles (fp32 master, fp32 gradient, bf16 copy), the micro-batch inputs.
//
// The CUDA model mirrors the CPU model (model/*.h) layer by layer with bf16 activations and
// weights, fp32 statistics, gradients and optimizer state; it is tested against it on the GPU.
#pragma once

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/core/dtype.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/cuda/activation_offload.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron::cuda {

// The CUDA model's two element types, by the short names its GEMM calls use.
inline constexpr DType BF = DType::BF16;
inline constexpr DType F32 = DType::F32;

// Registers pointers to device buffers; resolve() fills them once the plan is allocated. The
// registered pointer variables must not move (modules live behind unique_ptr).
class CudaBuffers {
  public:
    explicit CudaBuffers(MemoryPlan& plan) : plan_(plan) {}
    template <typename T>
    void act(T*& ptr, const std::string& name, std::vector<int64_t> shape) {
        refs_.emplace_back(plan_.add(MemClass::Activations, name, dtype_of<T>(), std::move(shape)),
                           reinterpret_cast<void**>(&ptr));
    }
    // A derived copy of parameters (e.g. their FP8 quantization): planned with the parameters.
    template <typename T>
    void param_copy(T*& ptr, const std::string& name, std::vector<int64_t> shape) {
        refs_.emplace_back(plan_.add(MemClass::Parameters, name, dtype_of<T>(), std::move(shape)),
                           reinterpret_cast<void**>(&ptr));
    }
    // Workspace shared by name: every module asking for the same name gets the same buffer. In a
    // phase (below) it lies in that phase's part of the workspace.
    template <typename T>
    void scratch(T*& ptr, const std::string& name, std::vector<int64_t> shape) {
        auto it = scratch_.find(name);
        MemoryPlan::Slot s;
        if (it == scratch_.end()) {
            s = scratch_[name] =
                phase_.empty()
                    ? plan_.add(MemClass::Workspace, name, dtype_of<T>(), shape)
                    : plan_.add_in_phase(MemClass::Workspace, phase_, name, dtype_of<T>(), shape);
        } else {
            s = it->second;
            const PlanEntry& e = plan_.entries()[s];
            ST_ASSERT(e.shape == shape && e.dtype == dtype_of<T>(), "scratch '", name,
                      "' redeclared with another shape");
            ST_ASSERT(e.phase == phase_, "scratch '", name, "' declared in phase '", e.phase,
                      "' and in phase '", phase_, "'");
        }
        refs_.emplace_back(s, reinterpret_cast<void**>(&ptr));
    }
    // The scratch declared while a Phase lives belongs to it (MemoryPlan::add_in_phase): the
    // modules of one layer that never run at once (its attention with its indexer, its MoE, its
    // dense MLP) each write and read their scratch only inside their own forward or backward, so
    // their scratch shares one area. Regions (in_region) stay outside phases: their users span
    // modules.
    class Phase {
      public:
        Phase(CudaBuffers& B, std::string name) : B_(B), outer_(std::move(B.phase_)) {
            B.phase_ = std::move(name);
        }
        ~Phase() { B_.phase_ = std::move(outer_); }
        Phase(const Phase&) = delete;
        Phase& operator=(const Phase&) = delete;

      private:
        CudaBuffers& B_;
        std::string outer_;
    };
    // Workspace in a region shared with buffers that are never live at the same time as this
    // one (the losses' rows, live only inside the losses between the forward and the backward,
    // and gradients of a layer backward that die in turn): the region is one buffer as large as
    // its largest user, planned by plan_regions() once every module has declared. Name a region
    // after its users; no two of them may be live at once.
    template <typename T>
    void in_region(T*& ptr, const std::string& region, const std::vector<int64_t>& shape) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        Region& r = regions_[region];
        r.bytes = std::max(r.bytes, n * int64_t(dtype_size(dtype_of<T>())));
        r.users.push_back(reinterpret_cast<void**>(&ptr));
    }
    void plan_regions() {
        for (auto& [name, r] : regions_) {
            const MemoryPlan::Slot s = plan_.add(MemClass::Workspace, name, DType::U8, {r.bytes});
            for (void** p : r.users) refs_.emplace_back(s, p);
        }
        regions_.clear();
    }
    // A saved activation of the layer application being declared (set_application()) that waits
    // for its backward in host memory (model/cuda/activation_offload.h); the pointer is set when
    // the offload binds.
    template <typename T>
    void offloaded(T*& ptr, const std::string& name, std::vector<int64_t> shape) {
        ST_ASSERT(offload_ && application_ >= 0, "offloaded buffer '", name,
                  "' outside a layer application with activation offload");
        offload_->add(application_, name, dtype_of<T>(), shape, reinterpret_cast<void**>(&ptr));
    }
    // One layer application's saved activation: its own buffer (kept), the buffer `shared` that
    // every application writes in its forward and rewrites before its backward (recomputed), or
    // offloaded.
    enum class Saving { Kept, Recomputed, Offloaded };
    template <typename T>
    void saved(Saving how, T*& ptr, const std::string& name, const std::string& shared,
               std::vector<int64_t> shape) {
        if (how == Saving::Recomputed)
            scratch(ptr, shared, std::move(shape));
        else if (how == Saving::Offloaded)
            offloaded(ptr, name, std::move(shape));
        else
            act(ptr, name, std::move(shape));
    }
    void set_offload(ActivationOffload* offload) { offload_ = offload; }
    void set_application(int64_t g) { application_ = g; }
    void resolve() {
        for (auto& [slot, ptr] : refs_) *ptr = plan_.view(slot).data;
    }
    MemoryPlan& plan() { return plan_; }

  private:
    MemoryPlan& plan_;
    std::vector<std::pair<MemoryPlan::Slot, void**>> refs_;
    std::map<std::string, MemoryPlan::Slot> scratch_;
    struct Region {
        int64_t bytes = 0;
        std::vector<void**> users;
    };
    std::map<std::string, Region> regions_;
    std::string phase_;  // the scratch phase being declared (empty: none)
    ActivationOffload* offload_ = nullptr;
    int64_t application_ = -1;
};

// How a module's saved activation lives until its backward (ActivationPolicy::saves: recomputed
// before offloaded, else kept).
inline CudaBuffers::Saving saving(const ActivationPolicy& a, std::optional<RecomputeModule> r,
                                  std::optional<OffloadModule> o) {
    switch (a.saves(r, o)) {
        case ActivationPolicy::Saving::Recomputed:
            return CudaBuffers::Saving::Recomputed;
        case ActivationPolicy::Saving::Offloaded:
            return CudaBuffers::Saving::Offloaded;
        case ActivationPolicy::Saving::Kept:
            break;
    }
    return CudaBuffers::Saving::Kept;
}

// The FP8 blockwise copy of a weight W [rows, cols] that the kernels read (fp8_linear.h): W and
// W^T in e4m3 with their 128x128 scales, in one block so that one broadcast moves all four.
struct Fp8Copy {
    int64_t rows = 0, cols = 0;
    uint8_t* block = nullptr;
    // The block's size and its parts' offsets (each part 256-byte aligned: TMA and cuBLASLt
    // operand alignment).
    static int64_t bytes(int64_t rows, int64_t cols);
    int64_t bytes() const { return bytes(rows, cols); }
    uint8_t* q() const { return block; }
    float* s() const;
    uint8_t* qt() const;
    float* st() const;
};

struct CudaParam {
    // fp32 value (the optimizer's); null where the distributed optimizer keeps it on another
    // rank (the kernels then read `w` or `fp8`, which that rank's update reaches by broadcast).
    // It holds elements [first, first + held) of the parameter: all of them, or (split by rows)
    // this rank's rows.
    float* master = nullptr;
    int64_t first = 0, held = 0;
    // The gradient: fp32 in `grad`, or under bf16 gradient buffers (grad_reduce_in_bf16) for
    // the weights GEMMs write, bf16 in `grad16`; both null for buffers.
    float* grad = nullptr;
    bf16* grad16 = nullptr;
    bf16* w = nullptr;  // bf16 copy the kernels read (null when none does: FP8 weights)
    // The FP8 copy the distributed optimizer gathers (fp8_param_gather): the owner quantizes its
    // master into it after each update and broadcasts it. Null otherwise (an FP8 copy quantized
    // from a master every rank keeps, or none).
    const Fp8Copy* fp8 = nullptr;
    int64_t numel = 0;
    bool has_grad() const { return grad || grad16; }
    // The gradient as a GEMM's output: its address and type.
    void* grad_out() const { return grad16 ? static_cast<void*>(grad16) : grad; }
    DType grad_type() const { return grad16 ? DType::BF16 : DType::F32; }
    int64_t grad_bytes() const { return numel * (grad16 ? 2 : 4); }
};

// Whether parameter `name`'s gradient can be a bf16 buffer: the weights only GEMMs write (they
// add into bf16 with an fp32 sum, as Megatron's fused weight-gradient accumulation does). The
// embedding (atomic row adds), the router (an fp32 GEMM) and the norms (sums of fp32 partials)
// keep fp32 gradients.
bool bf16_gradient_allowed(const std::string& name);

// One handle per ParamStore entry.
class CudaParams {
  public:
    explicit CudaParams(const ParamStore& store) : store_(store) {}
    // Plans the bf16 copies, but of the parameters in `unread`: weights no kernel reads in bf16
    // (the FP8 linears' and experts', read through their FP8 copies), whose copy would cost
    // 2 bytes a parameter of memory and of the optimizer's writes every step. Their `w` stays
    // null, so a kernel that did read one fails at once instead of reading stale values.
    void plan_bf16(MemoryPlan& plan, const std::vector<int64_t>& unread);
    // A kernel reads parameter i's fp32 master (the router's GEMM, the FP8 quantizers): every
    // rank keeps that master, also under the distributed optimizer. Declared while the model is
    // built, before its masters are planned.
    // `by_gemm`: a cuBLASLt GEMM reads it (kept in device memory under optimizer offload: the
    // library's kernels are not promised to read host memory).
    void read_master(int64_t i, bool by_gemm = false) const {
        reads_master_.insert(i);
        if (by_gemm) gemm_reads_master_.insert(i);
    }
    bool master_read(int64_t i) const { return reads_master_.count(i) > 0; }
    bool master_read_by_gemm(int64_t i) const { return gemm_reads_master_.count(i) > 0; }
    // Parameter i's master as its rows [row0, row0 + rows) only (the distributed optimizer's
    // share of a parameter split by rows); instead of the store's value slot.
    void plan_master_rows(MemoryPlan& plan, int64_t i, int64_t row0, int64_t rows,
                          MemClass where = MemClass::Parameters);
    // Optimizer offload: parameter i's master (and the optimizer's state of it) is planned in
    // pinned host memory, which the kernels read and write in place.
    void set_master_on_host(int64_t i) { on_host_.insert(i); }
    bool master_on_host(int64_t i) const { return on_host_.count(i) > 0; }
    void bind(const MemoryPlan& plan);
    // After bind: parameter i is gathered in FP8 through `copy` (CudaParam::fp8).
    void gather_in_fp8(int64_t i, const Fp8Copy* copy) { all_[size_t(i)].fp8 = copy; }
    const ParamStore& store() const { return store_; }
    int64_t index(const std::string& name) const;  // throws when absent
    const CudaParam& operator[](int64_t i) const { return all_[i]; }
    size_t size() const { return all_.size(); }
    // bf16 copies from the fp32 masters (after loading or initializing the masters); the
    // parameters without a copy or without a master here are skipped.
    void refresh_bf16(const ExecContext& ctx) const;

    // A step's gradients without zeroing them all first (every gradient's bytes written, and every
    // weight-gradient GEMM then reading those zeros back): in each step every
    // gradient is either overwritten by its first writer (grad_beta), zeroed just before its
    // first addition (grad_to_add), zeroed at the step's start because the previous step did not
    // write it, or zeroed at the step's end because this one did not (finish_gradients). The
    // decisions follow the enqueue order on the host, so a captured step replays them. Const:
    // enqueue bookkeeping, not the parameters' values.
    // With `accumulate_only` every gradient is zeroed now and every writer adds: for work
    // captured once and replayed at any point of a step (dynamic CP's per-micro-batch graphs).
    void begin_gradients(const ExecContext& ctx, bool accumulate_only = false) const;
    // For a writer whose output covers the whole gradient (a GEMM's beta): 0 for the step's first
    // write (overwrite), 1 after it (add).
    float grad_beta(int64_t i) const;
    // For a writer that can only add (scatter, reductions): the fp32 gradient, zeroed first if
    // this is the step's first write of it.
    float* grad_to_add(const ExecContext& ctx, int64_t i) const;
    void finish_gradients(const ExecContext& ctx) const;

  private:
    const ParamStore& store_;
    mutable std::set<int64_t> reads_master_, gemm_reads_master_;
    std::set<int64_t> on_host_;
    std::vector<MemoryPlan::Slot> bf16_slots_;
    std::map<int64_t, std::pair<MemoryPlan::Slot, int64_t>> row_masters_;  // i -> (slot, first)
    std::vector<CudaParam> all_;
    void zero_grad(const ExecContext& ctx, size_t i) const;
    // Per parameter: written by the step's writers in this step / in the previous step (none
    // before the first step), zeroed in this step.
    mutable std::vector<uint8_t> written_, written_before_, zeroed_;
};

// The current micro-batch on the device, plus what the host knows about it.
struct CudaInputs {
    int64_t tokens = 0;
    int32_t* token_ids = nullptr;
    int32_t* targets = nullptr;
    int32_t* positions = nullptr;
    int32_t* row_begin = nullptr;  // first row of each row's document, -1 for padding
    int64_t real_rows = 0;         // rows inside documents (host-side count of this micro-batch)
    // The micro-batch's loss scales on the device (graph-safe: kernels read them there):
    // [0] LM gradient per target row, [1] the indexer loss's gradient per real row
    // (scale x coeff / rows), [2 + k] MTP depth k's row weight (one value for e2e_tv).
    const float* loss_scales = nullptr;
    // Context parallelism (key_row null: none): these rows are some of a micro-batch of
    // key_tokens rows, key_row[t] (device) the micro-batch row of row t (-1: padding); keys are
    // gathered and key gradients summed over `cp` (device collectives).
    int64_t key_tokens = 0;
    int32_t* key_row = nullptr;
    Comm* cp = nullptr;
    // Every rank's key_row, rank-major ([cp size, tokens]; gathered by the model at the start
    // of each forward over a CP group of more than one rank): cp_keys.h's exchange.
    int32_t* all_key_rows = nullptr;
    // Without CP: row t's own index (-1 for padding), so kernels that take query rows against
    // key rows run on blocks of query rows (the indexer streams its scores that way).
    int32_t* rows = nullptr;
    // A pipeline stage's forward run again before its backward (CudaGlm5Model::enqueue_forward):
    // the indexer loss and the routing statistics were taken the first time.
    bool recompute = false;
    // The documents, for the MoE sequence aux loss (ops/moe/sequence_aux.h), `docs` of them
    // (the plan's bound; later ones empty): this rank's rows of document d are
    // [doc_rows[d], doc_rows[d + 1]); doc_fscale[d] = E / (k n_d) and doc_weight[d] = α λ /
    // (D n_d), n_d its rows in the micro-batch (every CP rank's). Device.
    int64_t docs = 0;
    const int32_t* doc_rows = nullptr;
    const float* doc_fscale = nullptr;
    const float* doc_weight = nullptr;
};

// Sum over the CP group on the step's stream (nothing without one).
inline void cp_allreduce(const ExecContext& ctx, const CudaInputs& in, float* x, int64_t n) {
    if (in.cp) in.cp->device_allreduce_sum(x, n, ctx.stream);
}

class MoeStash;
class Fp8Weights;

// What every module shares: norm weight-gradient partials, the MoE paged stash (null when off),
// the FP8 linear weights (fp8_recipe: blockwise; null in bf16), the documents a micro-batch holds
// at most.
struct CudaShared {
    float* norm_ws = nullptr;
    int64_t max_docs = 0;
    const MoeStash* moe_stash = nullptr;
    Fp8Weights* fp8 = nullptr;
};

}  // namespace sparsetron::cuda
