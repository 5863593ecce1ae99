// The CPU step engine: the CPU model computes on the host plan; gradients and routing statistics
// are summed over the ranks (MPI) in fixed ranges, the optimizer steps the parameters this rank
// owns under a distributed optimizer and their owners broadcast them after.
#include <map>
#include <memory>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/model/param_table.h"
#include "sparsetron/optim/owner_assignment.h"
#include "sparsetron/runtime/cpu/grad_ranges.h"
#include "sparsetron/runtime/cpu/pipeline_schedule.h"
#include "sparsetron/runtime/host_memory_check.h"
#include "sparsetron/runtime/stage_metrics.h"
#include "sparsetron/runtime/step_engine.h"

namespace sparsetron {
namespace {

class CpuEngine final : public StepEngine {
  public:
    CpuEngine(const Recipe& recipe, TrainingPlan& tp, const Communicators& comms)
        : run_(recipe.run), tp_(tp), comms_(comms) {
        ST_ASSERT(!tp.cpu_models.empty(), "the CPU engine needs the training plan's CPU models");
        for (const auto& m : tp.cpu_models) models_.push_back(m.get());
        ST_ASSERT(models_.size() == 1 || comms_.pipeline,
                  "several stage models on a rank without a pipeline");
        if (!tp_.plan.allocated()) {
            check_host_memory_for_cpu_plan(tp_.plan.total_bytes());
            tp_.plan.allocate(Device::CPU);
        }
        for (Glm5Model<float>* m : models_) m->bind();
        grad_ranges_ = gradient_ranges(*tp_.params, tp_.plan);
        if (run_.expert_model_parallel_size > 1) {
            for (Glm5Model<float>* m : models_) m->set_expert_parallel(comms_.expert);
            tp_.optimizer->set_expert_parallel(comms_.expert);
        }
        if (run_.context_parallel_size > 1 && !run_.dynamic_context_parallel)
            for (Glm5Model<float>* m : models_) m->set_context_parallel(comms_.context);
        if (comms_.pipeline) {
            tp_.optimizer->set_pipeline_parallel(comms_.pipeline);
            pipeline_ = std::make_unique<PipelineSchedule>(models_, *comms_.pipeline,
                                                           run_.microbatches_per_step());
        }
        for (const auto& p : tp_.params->params())
            indexer_only_.push_back(is_indexer_param(p.name));
        // With one rank the distributed optimizer is the plain one.
        if (run_.use_distributed_optimizer && comms_.world && comms_.world->size() > 1)
            assign_owners();
    }

    // The host plan is the engine's state.
    void upload_state() override {}
    void download_state() override {
        if (!owner_.empty()) broadcast_from_owners(/*state=*/true);
    }

    StepOutcome run_step(const StepWork& w) override {
        const bool dynamic = !w.cp_groups.empty();
        const bool warmup = run_.dsa_dense_warmup;
        StepOutcome out;
        zero_grads(tp_.plan);
        for (Glm5Model<float>* m : models_) m->reset_moe_stats();
        Glm5Model<float>& model = *models_.front();
        if (pipeline_) {
            out.losses =
                pipeline_->run(w.micro_batches, dynamic ? &w.cp_groups : nullptr, w.scales);
        } else {
            for (size_t i = 0; i < w.micro_batches.size(); ++i) {
                if (dynamic) model.set_context_parallel(w.cp_groups[i]);
                model.load_inputs(*w.micro_batches[i]);
                out.losses.push_back(model.forward_backward(w.scales));
            }
        }
        if (comms_.world && comms_.world->size() > 1) reduce_over_ranks(out);
        if (!pipeline_) {
            out.moe_load = model.moe_loads();
            out.moe_dropped = model.moe_dropped();
        }
        const bool shard = !owner_.empty();
        out.stats = tp_.optimizer->step(tp_.plan, run_, w.update, warmup ? &indexer_only_ : nullptr,
                                        shard ? &owned_ : nullptr);
        // Distributed optimizer: every parameter from the rank that updated it (the skip
        // decision and the clipping factor are the same on every rank: the gradients are).
        if (shard && !out.stats.skipped) broadcast_from_owners(/*state=*/false);
        if (!out.stats.skipped && !warmup)
            for (Glm5Model<float>* m : models_)
                m->update_router_bias(tp_.model.moe_router_bias_update_rate);
        return out;
    }

    std::vector<LossSums> forward_only(const std::vector<const MicroBatch*>& mbs,
                                       const LossScales& sc) override {
        ST_ASSERT(!sc.backward, "forward_only runs no backward");
        if (pipeline_) return pipeline_->run(mbs, nullptr, sc);
        std::vector<LossSums> out;
        for (const MicroBatch* mb : mbs) {
            models_.front()->load_inputs(*mb);
            out.push_back(models_.front()->forward_backward(sc));
        }
        return out;
    }

    std::string describe() const override { return cat("cpu (", num_threads(), " threads)"); }
    double memory_in_use_gib() const override {
        return double(tp_.plan.total_bytes()) / double(1ull << 30);
    }

  private:
    // Gradients over the stage's ranks (every rank without pipeline parallelism; the sharded
    // experts' over the ranks holding the same experts, none when every rank holds others), the
    // pipeline's shared embedding, and the routing statistics.
    void reduce_over_ranks(StepOutcome& out) {
        Comm* stage = comms_.stage;
        Comm* edp = run_.expert_model_parallel_size > 1 ? comms_.expert_data : stage;
        for (const GradRange& g : grad_ranges_) {
            Comm* over = g.routed_expert ? edp : stage;
            if (over && over->size() > 1) over->allreduce_sum(g.begin, g.count);
        }
        reduce_shared_embedding();
        reduce_moe_stats(out);
    }

    // Pipeline parallelism with MTP: the first stage's embedding gradient and the last stage's
    // copy's, summed (both then take the same update).
    void reduce_shared_embedding() {
        if (!comms_.embedding || comms_.embedding->size() < 2) return;
        if (tp_.model.mtp_num_layers == 0) return;  // the last stage holds no copy
        const int64_t i = tp_.params->index_of("model.embed_tokens.weight");
        ST_ASSERT(i >= 0, "pipeline: the embedding is not on this stage");
        const ParamInfo& p = tp_.params->params()[size_t(i)];
        comms_.embedding->allreduce_sum(tp_.plan.view(p.grad_slot).ptr<float>(), p.numel());
    }

    // The routing statistics summed over the ranks holding each MoE layer; under pipeline
    // parallelism every stage's layers in the outcome.
    void reduce_moe_stats(StepOutcome& out) {
        if (!pipeline_) {
            Glm5Model<float>& model = *models_.front();
            std::vector<int64_t> mine = model.moe_stats_flat();
            std::vector<double> st(mine.begin(), mine.end());
            comms_.world->allreduce_sum(st.data(), int64_t(st.size()));
            for (size_t k = 0; k < st.size(); ++k) mine[k] = int64_t(st[k]);
            model.set_moe_stats_flat(mine);
            return;
        }
        // Stages hold other MoE layers: the whole model's statistics are the stages' flat
        // vectors one after another (the MTP layer's come last). One sum over every rank adds
        // each stage's data-parallel replicas and fills in the other stages.
        std::vector<std::vector<double>> chunks;
        for (Glm5Model<float>* m : models_) {
            const std::vector<int64_t> s = m->moe_stats_flat();
            chunks.emplace_back(s.begin(), s.end());
        }
        std::vector<size_t> offsets;
        const std::vector<double> all =
            stages_concatenated(*comms_.pipeline, *comms_.world, chunks, &offsets);
        for (size_t v = 0; v < models_.size(); ++v) {
            std::vector<int64_t> mine(chunks[v].size());
            for (size_t k = 0; k < mine.size(); ++k) mine[k] = int64_t(all[offsets[v] + k]);
            models_[v]->set_moe_stats_flat(mine);
        }
        moe_metrics_from_stages(tp_.model, all, out.moe_load, out.moe_dropped);
    }

    void assign_owners() {
        // Owners are ranks of this stage (the ranks holding the same parameters).
        owner_ = parameter_owners(*tp_.params, run_, comms_.stage->size());
        const bool sharded = run_.expert_model_parallel_size > 1;
        const auto& params = tp_.params->params();
        owned_.assign(params.size(), false);
        // A row-split parameter: every rank updates it whole here (the CPU ranks keep every
        // master and state tensor; the split shards memory on CUDA).
        for (size_t i = 0; i < params.size(); ++i)
            owned_[i] = owner_[i] == comms_.stage->rank() || owner_[i] == kRowSplit ||
                        (sharded && params[i].routed_expert && params[i].trainable);
    }

    // Parameters (state: the optimizer state tensors instead) from their owners to every rank.
    void broadcast_from_owners(bool state) {
        if (!state) {
            const auto& params = tp_.params->params();
            for (size_t i = 0; i < params.size(); ++i)
                if (owner_[i] >= 0)
                    comms_.stage->broadcast(tp_.plan.view(params[i].param_slot).data,
                                            int64_t(params[i].numel() * sizeof(float)), owner_[i]);
            return;
        }
        broadcast_state_from_owners(*comms_.stage, *tp_.params, *tp_.optimizer, tp_.plan, owner_);
    }

    const RunConfig& run_;
    TrainingPlan& tp_;
    std::vector<Glm5Model<float>*> models_;  // this rank's stages (chunks under interleaving)
    Communicators comms_;
    std::vector<GradRange> grad_ranges_;
    std::unique_ptr<PipelineSchedule> pipeline_;
    std::vector<bool> indexer_only_;  // parameters the dense warm-up updates
    std::vector<int> owner_;          // distributed optimizer: owning rank per parameter (-1: none)
    std::vector<bool> owned_;         // ... and whether this rank updates it
};

}  // namespace

std::unique_ptr<StepEngine> make_cpu_engine(const Recipe& recipe, TrainingPlan& plan,
                                            const Communicators& comms) {
    return std::make_unique<CpuEngine>(recipe, plan, comms);
}

}  // namespace sparsetron
