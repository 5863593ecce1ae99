// The CUDA DeviceEngine: a CudaSession, the device plan (parameters, gradients, optimizer state,
// activations, workspace), the CUDA model and optimizer.
#include <iostream>
#include <map>

#include "sparsetron/core/device_memory.h"
#include "sparsetron/model/gpu/gpu_model.h"
#include "sparsetron/ops/cuda/cuda_session.h"
#include "sparsetron/ops/cuda/step_graph.h"
#include "sparsetron/runtime/device_engine.h"
#include "sparsetron/runtime/gpu/gpu_optimizer.h"

namespace sparsetron {
namespace {

class CudaEngine final : public DeviceEngine {
  public:
    CudaEngine(const Recipe& recipe, const ParamStore& host_store, const MemoryPlan& host_plan,
               const Optimizer& host_optimizer, int64_t max_documents, int64_t chunk_rows)
        : recipe_(recipe),
          host_store_(host_store),
          host_plan_(host_plan),
          host_optimizer_(host_optimizer) {
        ST_CHECK(!recipe.run.dsa_dense_warmup,
                 "dsa_dense_warmup is not implemented on CUDA yet; run the warm-up with --device "
                 "cpu or drop the key");
        const int64_t slots = recipe.run.tokens_per_microbatch();
        model_ = std::make_unique<gpu::GpuModel>(recipe_.model, host_store, plan_, slots,
                                                 max_documents, chunk_rows);
        opt_ = std::make_unique<gpu::GpuOptimizer>(model_->gpu_params(), plan_, recipe_.model,
                                                   recipe_.run);
        plan_.allocate(Device::CUDA);
        model_->bind(ctx());
        opt_->bind(plan_);
        cuda::zero(ctx(), plan_.class_base(MemClass::OptimizerState),
                   plan_.class_bytes(MemClass::OptimizerState));
    }

    void upload_state() override {
        const auto& hp = host_store_.params();
        const auto& gp = model_->gpu_params();
        for (size_t i = 0; i < hp.size(); ++i)
            copy_to_device(gp[int64_t(i)].master, host_plan_.view(hp[i].param_slot).data,
                           hp[i].numel() * sizeof(float));
        for (auto& [dev_slot, host_slot] : state_pairs())
            copy_to_device(plan_.view(dev_slot).data, host_plan_.view(host_slot).data,
                           plan_.entries()[dev_slot].bytes);
        model_->refresh_bf16(ctx());
        session_.synchronize();
    }

    void download_state() override {
        session_.synchronize();
        const auto& hp = host_store_.params();
        const auto& gp = model_->gpu_params();
        for (size_t i = 0; i < hp.size(); ++i)
            copy_to_host(host_plan_.view(hp[i].param_slot).data, gp[int64_t(i)].master,
                         hp[i].numel() * sizeof(float));
        for (auto& [dev_slot, host_slot] : state_pairs())
            copy_to_host(host_plan_.view(host_slot).data, plan_.view(dev_slot).data,
                         plan_.entries()[dev_slot].bytes);
    }

    void begin_step() override {
        cuda::zero(ctx(), plan_.class_base(MemClass::Gradients),
                   plan_.class_bytes(MemClass::Gradients));
        model_->reset_moe_stats(ctx());
    }

    LossSums micro_batch(const MicroBatch& mb, const LossScales& scales) override {
        model_->load_inputs(ctx(), mb);
        return model_->forward_backward(ctx(), scales);
    }

    std::vector<std::vector<int64_t>> moe_loads() override { return model_->moe_loads(ctx()); }
    int64_t moe_dropped() override { return model_->moe_dropped(ctx()); }

    StepStats optimizer_step(const RunConfig& run, int64_t step) override {
        return opt_->step(ctx(), run, step);
    }

    void update_router_bias(double rate) override { model_->update_router_bias(ctx(), rate); }

    std::string describe() const override {
        return cat(cuda_device_name(), ", planned device memory ",
                   format_bytes(double(plan_.total_bytes())));
    }

    void stage_inputs(const MicroBatch& mb) override { model_->load_inputs(ctx(), mb); }

    double timed_step(bool graph, bool optimizer, const LossScales& scales, int64_t micro_batches,
                      const RunConfig& run, int64_t step) override {
        auto enqueue = [&] {
            cuda::zero(ctx(), plan_.class_base(MemClass::Gradients),
                       plan_.class_bytes(MemClass::Gradients));
            model_->reset_moe_stats(ctx());
            for (int64_t i = 0; i < micro_batches; ++i) model_->enqueue(ctx(), scales);
            if (optimizer) opt_->enqueue_step(ctx(), run, step);
        };
        if (!graph) return session_.time_ms(enqueue, 1, 0).front();
        const std::pair<int64_t, bool> signature{micro_batches, optimizer};
        if (!graph_ || graph_signature_ != signature) {
            if (graph_) std::cerr << "[graph] step signature changed: re-capturing\n";
            graph_ = std::make_unique<cuda::StepGraph>(session_);
            graph_->begin_capture();
            enqueue();
            graph_->end_capture();
            graph_signature_ = signature;
            std::cerr << "[graph] captured the step: " << graph_->nodes() << " nodes ("
                      << micro_batches << " micro-batches" << (optimizer ? " + optimizer" : "")
                      << ")\n";
        }
        return session_.time_ms([&] { graph_->replay(); }, 1, 0).front();
    }

    double memory_in_use_mib() const override {
        return double(device_memory_used()) / (1024.0 * 1024.0);
    }
    double planned_memory_mib() const override {
        return double(plan_.total_bytes()) / (1024.0 * 1024.0);
    }

  private:
    const ExecContext& ctx() const { return session_.ctx(); }
    // (device slot, host slot) of every optimizer state tensor, matched by checkpoint name.
    std::vector<std::pair<MemoryPlan::Slot, MemoryPlan::Slot>> state_pairs() const {
        std::map<std::string, MemoryPlan::Slot> host;
        for (auto& [name, slot] : host_optimizer_.state_tensors()) host[name] = slot;
        std::vector<std::pair<MemoryPlan::Slot, MemoryPlan::Slot>> out;
        for (auto& [name, slot] : opt_->state_tensors()) {
            auto it = host.find(name);
            ST_CHECK(it != host.end(), "optimizer state '", name, "' has no host mirror");
            out.emplace_back(slot, it->second);
        }
        return out;
    }

    Recipe recipe_;
    const ParamStore& host_store_;
    const MemoryPlan& host_plan_;
    const Optimizer& host_optimizer_;
    cuda::CudaSession session_;
    MemoryPlan plan_;
    std::unique_ptr<gpu::GpuModel> model_;
    std::unique_ptr<gpu::GpuOptimizer> opt_;
    std::unique_ptr<cuda::StepGraph> graph_;  // timed_step's graph (bench)
    std::pair<int64_t, bool> graph_signature_{0, false};
};

}  // namespace

std::string format_cuda_plan(const Recipe& recipe, const ParamStore& host_store,
                             int64_t max_documents, int64_t chunk_rows, size_t* total_bytes) {
    MemoryPlan plan;
    gpu::GpuModel model(recipe.model, host_store, plan, recipe.run.tokens_per_microbatch(),
                        max_documents, chunk_rows);
    gpu::GpuOptimizer opt(model.gpu_params(), plan, recipe.model, recipe.run);
    if (total_bytes) *total_bytes = plan.total_bytes();
    return plan.format();
}

std::unique_ptr<DeviceEngine> make_cuda_engine(const Recipe& recipe, const ParamStore& host_store,
                                               const MemoryPlan& host_plan,
                                               const Optimizer& host_optimizer,
                                               int64_t max_documents, int64_t chunk_rows) {
    // Before any CUDA call, so a machine without a GPU gets this message, not a driver error.
    ST_CHECK(cuda_available(), "--device cuda: no CUDA device is visible (",
             "nvidia-smi lists none, or the driver is older than CUDA 13); use --device cpu");
    return std::make_unique<CudaEngine>(recipe, host_store, host_plan, host_optimizer,
                                        max_documents, chunk_rows);
}

}  // namespace sparsetron
