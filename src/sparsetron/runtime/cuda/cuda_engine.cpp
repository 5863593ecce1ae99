// The CUDA step engine: a CudaSession, the device plan (parameters, gradients, optimizer state,
// activations, workspace), the CUDA model and optimizer, mirroring the host plan's parameters and
// optimizer state.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <tuple>

#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/core/device_memory.h"
#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/cuda/side_stream.h"
#include "sparsetron/cuda/step_graph.h"
#include "sparsetron/model/cuda/glm5_model.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/optim/cuda/cuda_optimizer.h"
#include "sparsetron/optim/owner_assignment.h"
#include "sparsetron/parallel/comm/collective_watchdog.h"
#include "sparsetron/parallel/context/cp_row_plan.h"
#include "sparsetron/runtime/cuda/cuda_pipeline.h"
#include "sparsetron/runtime/cuda/master_placement.h"
#include "sparsetron/runtime/cuda/step_staging.h"
#include "sparsetron/runtime/cuda_plan.h"
#include "sparsetron/runtime/host_memory_check.h"
#include "sparsetron/runtime/stage_metrics.h"
#include "sparsetron/runtime/step_engine.h"

namespace sparsetron {
namespace {

class CudaEngine final : public StepEngine, public StepBench {
  public:
    CudaEngine(const Recipe& recipe, TrainingPlan& tp, const Communicators& comms)
        : recipe_(recipe),
          host_store_(*tp.params),
          host_plan_(tp.plan),
          host_optimizer_(*tp.optimizer),
          comms_(comms),
          dp_(comms.stage && comms.stage->size() > 1 ? comms.stage : nullptr) {
        Comm* expert_parallel = comms.expert;
        Comm* context_parallel = comms.context;
        Comm* expert_data_parallel = comms.expert_data;
        Comm* pipeline = comms.pipeline;
        Comm* embedding = comms.embedding;
        const int64_t max_documents = tp.max_documents, chunk_rows = tp.chunk_rows;
        // The host keeps what checkpoints hold; the step's memory is the device plan.
        if (!tp.plan.allocated())
            tp.plan.allocate_only(Device::CPU, {MemClass::Parameters, MemClass::OptimizerState});
        ST_CHECK(!dp_ || dp_->on_device(),
                 "CUDA data parallelism needs device collectives (NCCL); ", "the ",
                 dp_ ? dp_->name() : "", " communicator has none");
        // The MoE layers plan for the expert-parallel group's size (make_training_plan's rule);
        // the trainer set the rank whose experts this process holds.
        recipe_.model.expert_parallel_ranks = recipe_.run.expert_model_parallel_size;
        // Sharded experts: their gradients are summed over the ranks holding the same experts.
        if (expert_parallel && expert_parallel->size() > 1)
            edp_ = expert_data_parallel && expert_data_parallel->size() > 1 ? expert_data_parallel
                                                                            : nullptr;
        else
            edp_ = dp_;
        ST_CHECK(
            recipe_.model.expert_parallel_ranks == 1 ||
                (expert_parallel && expert_parallel->size() == recipe_.model.expert_parallel_ranks),
            "expert_model_parallel_size ", recipe_.model.expert_parallel_ranks,
            " needs an expert-parallel group of that many processes");
        // The dense warm-up (SPEC §3.2): attention over every key and the dense indexer loss
        // (make_training_plan's model); each step a forward that computes the indexer's
        // gradient, the indexer alone updated (CudaOptimizer) and no router bias update.
        if (recipe.run.dsa_dense_warmup) {
            recipe_.model.dsa_indexer_topk = tp.model.dsa_indexer_topk;
            recipe_.model.dsa_indexer_use_sparse_loss = tp.model.dsa_indexer_use_sparse_loss;
        }
        const int64_t slots = recipe.run.tokens_per_microbatch();
        // Context parallelism: this rank's chunks of every document (the CPU model's plan);
        // dynamic CP: the largest group's micro-batch, a CP group given per micro-batch.
        const int cp = static_cast<int>(recipe.run.context_parallel_size);
        dynamic_cp_ = recipe.run.dynamic_context_parallel;
        ST_CHECK(cp == 1 || dynamic_cp_ || (context_parallel && context_parallel->size() == cp),
                 "context_parallel_size ", cp,
                 " needs a context-parallel group of that many processes");
        const CpRowPlan cpp = cp_row_plan(recipe.run, slots, max_documents);
        recipe_.model.context_parallel_ranks = cpp.max_group;
        // Pipeline parallelism: this rank's stages of the model (its chunks under interleaving),
        // the pipeline timetable over the step's micro-batches (runtime/cuda/cuda_pipeline.h).
        Comm* pp = pipeline && pipeline->size() > 1 ? pipeline : nullptr;
        std::vector<PipelineStage> stages;  // none: the whole model
        if (pp) {
            ST_CHECK(recipe.run.pipeline_model_parallel_size == pp->size(),
                     "pipeline_model_parallel_size ", recipe.run.pipeline_model_parallel_size,
                     " but the pipeline group has ", pp->size(), " ranks");
            stages = pipeline_rank_stages(recipe_.model, recipe_.run, pp->rank());
        }
        // The distributed optimizer: masters and state sharded over the ranks holding the same
        // parameters.
        shard_ = dp_ ? optimizer_shard(host_store_, recipe_.run, dp_->rank(), dp_->size())
                     : OptimizerShard{};
        model_ = std::make_unique<cuda::CudaGlm5Model>(
            recipe_.model, host_store_, plan_, cpp.rows, cpp.max_documents,
            std::min(chunk_rows, cpp.rows), cpp.key_rows, recipe_.run.fp8_blockwise(), stages,
            master_placement(shard_, recipe_.run));
        opt_ = std::make_unique<cuda::CudaOptimizer>(model_->cuda_params(), plan_, recipe_.model,
                                                     recipe_.run, shard_, dp_, expert_parallel, pp);
        if (pp) {
            pipeline_ = std::make_unique<CudaPipeline>(*model_, *pp, plan_,
                                                       pipeline_step_bound(recipe_.run));
            // The last stage's copy of the embedding (MTP reads it) and the first stage's: one
            // gradient, summed over the pair.
            if (embedding && embedding->size() > 1 && model_->embedding_param() >= 0)
                embedding_ = embedding;
        }
        if (recipe_.run.cuda_graph_impl == "full_iteration" || pipeline_) {
            graphs_ = recipe_.run.cuda_graph_impl == "full_iteration";
            if (graphs_ && pipeline_ && dynamic_cp_ && (!comms_.world || comms_.world->rank() == 0))
                std::cerr << "[graph] dynamic CP with pipeline stages: the steps run eagerly "
                             "(their groups and micro-batches change from step to step); "
                             "cuda_graph_impl: local captures each layer's chunk instead\n";
            // Staging for a whole step: every micro-batch's input block and loss sums.
            const StepStaging staging =
                plan_step_staging(*model_, plan_, recipe_.run.microbatches_per_step());
            slots_ = staging.slots, s_slots_ = staging.inputs, s_sums_ = staging.sums;
            s_index_ = staging.index;
        }
        // Pipeline parallelism with the paged stash or the receive budget: one stage's overflow
        // redoes the step on every stage (some of which may hold no MoE layer): flags on every
        // rank, [0] the stash's overflow, [1] the receive budget's.
        if (pipeline_ &&
            (recipe.model.moe_paged_stash || recipe.model.moe_expert_rank_capacity_factor > 0))
            s_redo_veto_ =
                plan_.add(MemClass::Activations, "pipeline.moe_redo_flags", DType::I32, {2});
        // Say what would fit before cudaMalloc fails on a number.
        const std::string shortfall =
            cuda_plan_shortfall(recipe, host_store_, max_documents, chunk_rows, plan_.total_bytes(),
                                device_memory_free(), stages, shard_.rank);
        ST_CHECK(shortfall.empty(), shortfall);
        const uint64_t host_free = available_host_memory();
        ST_CHECK(host_free == 0 || plan_.host_offload_bytes() <= host_free,
                 "activation offload needs ", format_bytes(double(plan_.host_offload_bytes())),
                 " of pinned host memory but the host has ", format_bytes(double(host_free)),
                 " available; offload fewer offload_modules or recompute some (recompute_modules)");
        plan_.allocate(Device::CUDA);
        model_->bind(ctx());
        if (recipe_.run.cuda_graph_impl == "local") set_chunk_graphs(true);
        if (pipeline_) pipeline_->bind(plan_);
        if (cp > 1 && !dynamic_cp_) model_->set_context_parallel(context_parallel);
        opt_->bind(plan_);
        opt_->prepare(ctx());
        if (expert_parallel && expert_parallel->size() > 1) {
            // NVLink when the group shares a node (or as the recipe says), NCCL across nodes.
            const ExchangeTransport t = choose_exchange_transport(
                recipe_.run.moe_expert_exchange, expert_parallel->allgather(this_host_id()));
            exchange_ = cuda::make_expert_exchange(t, *expert_parallel,
                                                   exchange_shape(recipe_.model, cpp.rows));
            model_->set_expert_exchange(exchange_.get());
        }
        if (dp_) {
            plan_buckets();
            // Not with CP or the NCCL expert exchange: the backward's key-gradient all-reduces
            // (CP communicator) or the exchange's all-to-alls (EP communicator) would run
            // concurrently with the buckets' (world communicator) on the same GPUs, and NCCL
            // kernels of two communicators may then wait on each other in different orders on
            // two GPUs (a deadlock); the buckets are reduced after the backward instead.
            const bool nccl_exchange =
                exchange_ && exchange_->transport() == ExchangeTransport::Nccl;
            // Nor with pipeline parallelism: the stages' transfers (pipeline communicator) run
            // on the main stream during the last backward.
            if (recipe_.run.overlap_grad_reduce && cp == 1 && !dynamic_cp_ && !nccl_exchange &&
                !pipeline_)
                side_ = std::make_unique<cuda::SideStream>(ctx());
        }
        // A step whose MoE stash or receive budget overflowed computed its backward on missing
        // rows: skip it.
        if (s_redo_veto_ >= 0) {
            opt_->add_veto(redo_veto());
            opt_->add_veto(redo_veto() + 1);
        } else {
            if (const cuda::MoeStash* st = model_->moe_stash()) opt_->add_veto(st->overflow_flag());
            if (exchange_) opt_->add_veto(exchange_->over_budget());
        }
        cuda::zero(ctx(), plan_.class_base(MemClass::OptimizerState),
                   plan_.class_bytes(MemClass::OptimizerState));
        // Optimizer offload: the state planned in pinned host memory.
        for (const auto& [name, slot] : opt_->state_tensors())
            if (plan_.entries()[slot].cls == MemClass::HostOffload)
                std::memset(plan_.view(slot).data, 0, plan_.entries()[slot].bytes);
    }

    void upload_state() override {
        const auto& hp = host_store_.params();
        const auto& gp = model_->cuda_params();
        std::vector<bf16> copy;
        for (size_t i = 0; i < hp.size(); ++i) {
            const float* value = host_plan_.view(hp[i].param_slot).ptr<float>();
            const cuda::CudaParam& g = gp[int64_t(i)];
            if (g.master) copy_to_device(g.master, value + g.first, g.held * sizeof(float));
            if (g.w && g.held < g.numel) {
                // Its master is another rank's, or (split by rows) in part: the bf16 copy from
                // the host's (refresh_bf16 rewrites this rank's rows from the master).
                copy.resize(size_t(hp[i].numel()));
                for (size_t k = 0; k < copy.size(); ++k) copy[k] = float_to_bf16(value[k]);
                copy_to_device(g.w, copy.data(), copy.size() * sizeof(bf16));
            }
        }
        for (const StatePair& s : state_pairs())
            copy_to_device(plan_.view(s.device).data,
                           static_cast<char*>(host_plan_.view(s.host).data) + s.offset,
                           plan_.entries()[s.device].bytes);
        model_->refresh_bf16(ctx());
        if (shard_.sharded()) opt_->gather_fp8_copies(ctx());
        session_.synchronize();
    }

    void download_state() override {
        session_.synchronize();
        const auto& hp = host_store_.params();
        const auto& gp = model_->cuda_params();
        for (size_t i = 0; i < hp.size(); ++i) {
            const cuda::CudaParam& g = gp[int64_t(i)];
            if (g.master)
                copy_to_host(host_plan_.view(hp[i].param_slot).ptr<float>() + g.first, g.master,
                             g.held * sizeof(float));
        }
        for (const StatePair& s : state_pairs())
            copy_to_host(static_cast<char*>(host_plan_.view(s.host).data) + s.offset,
                         plan_.view(s.device).data, plan_.entries()[s.device].bytes);
        if (shard_.sharded()) {
            // Every master and state tensor from its owner (split by rows: each rank's rows from
            // it): each rank's host copy whole.
            for (size_t i = 0; i < hp.size(); ++i) {
                void* host = host_plan_.view(hp[i].param_slot).data;
                const int64_t bytes = hp[i].numel() * int64_t(sizeof(float));
                if (shard_.split(i))
                    gather_row_shares(*comms_.stage, host, bytes);
                else if (shard_.owner[i] >= 0)
                    comms_.stage->broadcast(host, bytes, shard_.owner[i]);
            }
            broadcast_state_from_owners(*comms_.stage, host_store_, host_optimizer_, host_plan_,
                                        shard_.owner);
        }
    }

    StepOutcome run_step(const StepWork& w) override {
        // The step's NCCL collectives run on the device: the host's wait for the step is what
        // the collective deadline watches.
        CollectiveWatchdog::Scope watched("the device step");
        const RunConfig& run = recipe_.run;
        StepOutcome out = run_step(w.micro_batches, w.scales, run, w.update,
                                   w.cp_groups.empty() ? nullptr : &w.cp_groups);
        out.moe_load = model_->moe_loads(ctx());
        out.moe_dropped = model_->moe_dropped(ctx());
        if (comms_.pipeline)
            gather_stage_moe_metrics(*comms_.pipeline, recipe_.model.num_experts,
                                     model_->moe_layers_per_stage(), out.moe_load, out.moe_dropped);
        if (!out.stats.skipped && !run.dsa_dense_warmup)
            model_->update_router_bias(ctx(), recipe_.model.moe_router_bias_update_rate);
        return out;
    }

  private:
    // The MoE's redo mode while alive: the stash bypassed and, under a receive budget, the
    // routed experts in token chunks that fit it.
    struct MoeRedo {
        cuda::CudaGlm5Model& m;
        explicit MoeRedo(cuda::CudaGlm5Model& model) : m(model) { m.set_moe_redo(true); }
        ~MoeRedo() { m.set_moe_redo(false); }
    };
    // The gradients are not zeroed here as a whole: each is overwritten by its first writer of
    // the step or zeroed where needed (CudaParams::begin_gradients), and end_backward() zeroes
    // what the step did not write.
    void begin_step(bool accumulate_only = false) {
        // Chunk-wise graphs replay a chunk's gradient writes at any place in the step.
        model_->cuda_params().begin_gradients(ctx(), accumulate_only || chunked_);
        model_->reset_moe_stats(ctx());
        if (exchange_) exchange_->clear_over_budget(ctx());
    }
    // After the last micro-batch's backward: the gradient reductions, then the gradients the
    // step did not write zeroed (after the reductions: a side stream may still read them).
    void end_backward() {
        finish_reduce();
        model_->cuda_params().finish_gradients(ctx());
        if (embedding_) {
            const cuda::CudaParam& e = model_->cuda_params()[model_->embedding_param()];
            embedding_->device_allreduce_sum(e.grad, e.numel, ctx().stream);
        }
        // One rank's stash overflow or receive budget overflow vetoes every rank's optimizer
        // step and sends all of them into the eager redo (which exchanges rows and reduces
        // gradients with the others): the ranks holding the same layers, and under pipeline
        // parallelism every rank (the redo runs every stage again).
        const cuda::MoeStash* st = model_->moe_stash();
        if (s_redo_veto_ >= 0) {
            gather_redo_flags();
        } else {
            if (dp_ && st) dp_->device_allreduce_max(st->overflow_flag(), 1, ctx().stream);
            if (dp_ && exchange_)
                dp_->device_allreduce_max(exchange_->over_budget(), 1, ctx().stream);
        }
    }
    // Pipeline parallelism: this rank's stash and budget flags, then their maximum over the world.
    void gather_redo_flags() {
        int32_t* flags = redo_veto();
        cuda::zero(ctx(), flags, 2 * sizeof(int32_t));
        if (const cuda::MoeStash* st = model_->moe_stash())
            cuda::copy_2d(ctx(), flags, 0, st->overflow_flag(), 0, sizeof(int32_t), 1);
        if (exchange_)
            cuda::copy_2d(ctx(), flags + 1, 0, exchange_->over_budget(), 0, sizeof(int32_t), 1);
        if (comms_.world && comms_.world->size() > 1)
            comms_.world->device_allreduce_max(flags, 2, ctx().stream);
    }

    LossSums micro_batch(const MicroBatch& mb, const LossScales& scales) {
        model_->load_inputs(ctx(), mb, scales);
        return model_->forward_backward(ctx(), scales);
    }

    StepOutcome run_step(const std::vector<const MicroBatch*>& mbs, const LossScales& sc,
                         const RunConfig& run, int64_t step, const std::vector<Comm*>* cp_groups) {
        const int64_t replays = chunks_ ? chunks_->replays() : 0;
        // Chunk-wise graphs: captured once the warm-up steps have run.
        if (chunks_ && chunked_ && ++chunk_steps_ > run.cuda_graph_warmup_steps)
            chunks_->set_capturing(true);
        StepOutcome out = run_step_once(mbs, sc, run, step, cp_groups, false);
        if (chunks_ && chunks_->replays() > replays) out.replayed = true;  // chunk-wise graphs
        if (!out.stash.overflow && !out.over_budget) return out;
        // The paged stash or the receive budget overflowed: the backward ran on missing rows and
        // the optimizer skipped the step on the device. As the seed falls back to an eager step:
        // the same step again, eagerly, with the stash bypassed (the MoE backward recomputes its
        // expert rows) and under a budget the routed experts in token chunks that fit it.
        const MoeRedo redo_mode(*model_);
        StepOutcome redo = run_step_once(mbs, sc, run, step, cp_groups, true);
        ST_ASSERT(!redo.stash.overflow, "the eager redo of step ", step, " pushed to the stash");
        ST_ASSERT(!redo.over_budget, "the eager redo of step ", step,
                  " went over the expert-parallel receive budget");
        redo.stash = out.stash;
        redo.over_budget = out.over_budget;
        redo.redone = true;
        return redo;
    }

    // One attempt at a step; `eager` runs it eagerly even where graphs are on.
    StepOutcome run_step_once(const std::vector<const MicroBatch*>& mbs, const LossScales& sc,
                              const RunConfig& run, int64_t step,
                              const std::vector<Comm*>* cp_groups, bool eager) {
        ST_CHECK(!cp_groups || dynamic_cp_, "CP groups per micro-batch are dynamic CP's");
        ST_CHECK(!dynamic_cp_ || (cp_groups && cp_groups->size() == mbs.size()),
                 "dynamic CP: every micro-batch needs its CP group");
        if (dynamic_cp_ && !pipeline_)
            return run_dynamic_cp_step(mbs, sc, run, step, cp_groups, eager);
        if (dynamic_cp_) return run_dynamic_cp_pipeline_step(mbs, sc, run, step, *cp_groups);
        StepOutcome out;
        if (!pipeline_ && (slots_ == 0 || eager)) {
            begin_step();
            for (size_t i = 0; i < mbs.size(); ++i) {
                if (i + 1 == mbs.size()) begin_reduce();
                out.losses.push_back(micro_batch(*mbs[i], sc));
            }
            end_backward();
            out.stats = opt_->step(ctx(), run, step);
            read_moe_use(out);
            return out;
        }
        const int64_t n = int64_t(mbs.size()), words = model_->input_words();
        ST_CHECK(n <= slots_, "a step of ", n, " micro-batches, but the step's staging holds ",
                 slots_, " (microbatches_per_step)");
        int32_t* slots = plan_.view(s_slots_).ptr<int32_t>();
        double* sums = plan_.view(s_sums_).ptr<double>();
        for (int64_t i = 0; i < n; ++i)
            model_->stage_inputs(ctx(), *mbs[size_t(i)], sc, slots + i * words);
        opt_->stage_schedule(ctx(), run, step);
        auto body = [&] {
            begin_step();
            if (pipeline_) {
                pipeline_->enqueue(ctx(), sc, n, slots, sums, [&] { begin_reduce(); });
                end_backward();
                opt_->enqueue_step(ctx(), run);
                return;
            }
            for (int64_t i = 0; i < n; ++i) {
                model_->copy_inputs_from(ctx(), slots + i * words);
                if (i + 1 == n) begin_reduce();
                model_->enqueue(ctx(), sc);
                const int64_t bytes = model_->n_sums() * int64_t(sizeof(double));
                cuda::copy_2d(ctx(), sums + i * model_->n_sums(), 0, model_->sums(), 0, bytes, 1);
            }
            end_backward();
            opt_->enqueue_step(ctx(), run);
        };
        const GraphSignature sig{n, sc.backward, sc.indexer_grads, sc.indexer != 0,
                                 int64_t(sc.mtp.size())};
        if (!graphs_ || eager) {
            body();  // eagerly (pipeline parallelism without graphs, or its redo)
        } else if (eager_steps_ < run.cuda_graph_warmup_steps) {
            body();  // a warm-up step: the same work, eagerly
            ++eager_steps_;
        } else {
            if (!step_graph_ || sig != step_sig_) {
                if (step_graph_)
                    std::cerr << "[graph] step signature changed (" << step_sig_.describe()
                              << " -> " << sig.describe() << "): re-capturing\n";
                step_graph_ = std::make_unique<cuda::StepGraph>(session_);
                step_graph_->begin_capture();
                body();
                step_graph_->end_capture();
                step_sig_ = sig;
                ++captures_;
                std::cerr << "[graph] captured the training step: " << step_graph_->nodes()
                          << " nodes, " << sig.describe() << "\n";
            }
            step_graph_->replay();
            out.replayed = true;
        }
        out.losses = read_staged_losses(sums, mbs);
        out.stats = opt_->read_stats(ctx(), run, step);
        read_moe_use(out);
        return out;
    }

    // Dynamic CP with pipeline stages: eagerly, since the groups and their number change from
    // step to step; each micro-batch is packed for its group and uploaded when the schedule
    // reaches it (a forward run again before its backward uploads it again), and its losses are
    // read after its forward, so nothing is staged per micro-batch.
    StepOutcome run_dynamic_cp_pipeline_step(const std::vector<const MicroBatch*>& mbs,
                                             const LossScales& sc, const RunConfig& run,
                                             int64_t step, const std::vector<Comm*>& cp_groups) {
        StepOutcome out;
        // Each micro-batch's loss sums, added over the chunks the rank holds.
        const int64_t ns = model_->n_sums();
        std::vector<double> raw(mbs.size() * size_t(ns), 0.0), chunk(static_cast<size_t>(ns));
        const PipelineHostFeed feed{[&](int64_t i) {
                                        model_->set_context_parallel(cp_groups[size_t(i)]);
                                        model_->load_inputs(ctx(), *mbs[size_t(i)], sc);
                                    },
                                    [&](int64_t i) {
                                        cuda::download(ctx(), chunk.data(), model_->sums(),
                                                       ns * int64_t(sizeof(double)));
                                        for (int64_t j = 0; j < ns; ++j)
                                            raw[size_t(i * ns + j)] += chunk[size_t(j)];
                                    }};
        opt_->stage_schedule(ctx(), run, step);
        begin_step();
        pipeline_->enqueue(ctx(), sc, int64_t(mbs.size()), feed, [&] { begin_reduce(); });
        end_backward();
        opt_->enqueue_step(ctx(), run);
        for (size_t i = 0; i < mbs.size(); ++i)
            out.losses.push_back(model_->losses_from(raw.data() + i * size_t(ns), *mbs[i]));
        out.stats = opt_->read_stats(ctx(), run, step);
        read_moe_use(out);
        return out;
    }

    // Dynamic CP: each micro-batch is a group's, with its own CP communicator. Eagerly (or the
    // redo): each micro-batch uploaded, run and its losses read in turn. With full_iteration the
    // step runs as graphs with no host synchronization between micro-batches: the micro-batches
    // staged on the device in rounds of the staging's slots; the step's start; per micro-batch
    // the graph of its kind (CP size and kind of step), which copies its input block from the
    // slot a device index names, runs it, writes its loss sums to that slot and advances the
    // index, so one capture serves every slot (the static plan is the graphs' one pool); and
    // the step's end (the gradient reductions and the optimizer). Each graph is captured after
    // an eager warm-up of its kind. Under expert parallelism the micro-batches run eagerly
    // between the graphs of the step's start and end: a rank's exchange pairs it with ranks of
    // other CP groups, whose kinds (and so their first runs and captures) differ at that
    // micro-batch, and a capture does not run its transfers.
    StepOutcome run_dynamic_cp_step(const std::vector<const MicroBatch*>& mbs, const LossScales& sc,
                                    const RunConfig& run, int64_t step,
                                    const std::vector<Comm*>* cp_groups, bool eager) {
        ST_CHECK(cp_groups && cp_groups->size() == mbs.size(),
                 "dynamic CP: every micro-batch needs its CP group");
        if (!graphs_ || eager) {
            StepOutcome out;
            begin_step(true);
            for (size_t i = 0; i < mbs.size(); ++i) {
                model_->set_context_parallel((*cp_groups)[i]);
                out.losses.push_back(micro_batch(*mbs[i], sc));
            }
            begin_reduce();
            end_backward();
            out.stats = opt_->step(ctx(), run, step);
            read_moe_use(out);
            return out;
        }
        const int64_t n = int64_t(mbs.size()), words = model_->input_words(), ns = model_->n_sums();
        int32_t* slots = plan_.view(s_slots_).ptr<int32_t>();
        double* sums = plan_.view(s_sums_).ptr<double>();
        int32_t* index = plan_.view(s_index_).ptr<int32_t>();
        const bool mb_graphs = !exchange_;
        opt_->stage_schedule(ctx(), run, step);
        graph_or_eager(dcp_start_, "the step's start", [&] { begin_step(true); });
        std::vector<double> host(size_t(n * ns));
        for (int64_t first = 0; first < n; first += slots_) {
            const int64_t m = std::min(slots_, n - first);
            for (int64_t j = 0; j < m; ++j) {
                model_->set_context_parallel((*cp_groups)[size_t(first + j)]);
                model_->stage_inputs(ctx(), *mbs[size_t(first + j)], sc, slots + j * words);
            }
            cuda::zero(ctx(), index, sizeof(int32_t));
            for (int64_t j = 0; j < m; ++j) {
                Comm* cp = (*cp_groups)[size_t(first + j)];
                model_->set_context_parallel(cp);
                auto body = [&] {
                    model_->copy_inputs_from_slot(ctx(), slots, index);
                    model_->enqueue(ctx(), sc);
                    cuda::copy_to_slot(ctx(), sums, model_->sums(), ns * int64_t(sizeof(double)),
                                       index);
                    cuda::increment(ctx(), index);
                };
                if (!mb_graphs) {
                    body();
                    continue;
                }
                const DynamicGraphKey key{cp ? cp->size() : 1, sc.backward, sc.indexer_grads,
                                          sc.indexer != 0, int64_t(sc.mtp.size())};
                graph_or_eager(cp_graphs_[key], cat("a CP-", std::get<0>(key), " micro-batch"),
                               body);
            }
            cuda::download(ctx(), host.data() + first * ns, sums, m * ns * int64_t(sizeof(double)));
        }
        graph_or_eager(dcp_end_, "the step's end (reductions, optimizer)", [&] {
            begin_reduce();
            end_backward();
            opt_->enqueue_step(ctx(), run);
        });
        StepOutcome out;
        out.replayed = dcp_end_.graph != nullptr;
        for (int64_t i = 0; i < n; ++i)
            out.losses.push_back(model_->losses_from(host.data() + i * ns, *mbs[size_t(i)]));
        out.stats = opt_->read_stats(ctx(), run, step);
        read_moe_use(out);
        return out;
    }
    // A graph of work that runs eagerly the first time (its warm-up: GEMM plans, first-use
    // allocations), is captured the second and replayed from then on.
    struct WarmGraph {
        bool warmed = false;
        std::unique_ptr<cuda::StepGraph> graph;
    };
    void graph_or_eager(WarmGraph& g, const std::string& what, const std::function<void()>& work) {
        if (!g.warmed) {
            work();
            g.warmed = true;
            return;
        }
        if (!g.graph) {
            g.graph = std::make_unique<cuda::StepGraph>(session_);
            g.graph->begin_capture();
            work();
            g.graph->end_capture();
            ++captures_;
            std::cerr << "[graph] captured " << what << ": " << g.graph->nodes() << " nodes\n";
        }
        g.graph->replay();
    }

  public:
    std::string describe() const override {
        return cat("cuda: ", cuda_device_name(), ", planned device memory ",
                   format_bytes(double(plan_.total_bytes())));
    }
    double memory_in_use_gib() const override {
        return double(device_memory_used()) / double(1ull << 30);
    }
    StepBench* bench() override { return this; }

    std::vector<LossSums> forward_only(const std::vector<const MicroBatch*>& mbs,
                                       const LossScales& sc) override {
        ST_CHECK(!sc.backward, "forward_only runs no backward");
        if (!pipeline_) {
            const auto pass = [&] {
                std::vector<LossSums> out;
                if (exchange_) exchange_->clear_over_budget(ctx());
                for (const MicroBatch* mb : mbs) out.push_back(micro_batch(*mb, sc));
                return out;
            };
            std::vector<LossSums> out = pass();
            if (!over_budget_anywhere()) return out;
            // Rows over the receive budget were dropped: the pass again in token chunks.
            const MoeRedo redo_mode(*model_);
            return pass();
        }
        const int64_t n = int64_t(mbs.size()), words = model_->input_words();
        ST_CHECK(n <= slots_, "a pipeline pass of ", n, " micro-batches, but its staging holds ",
                 slots_, " (microbatches_per_step)");
        int32_t* slots = plan_.view(s_slots_).ptr<int32_t>();
        double* sums = plan_.view(s_sums_).ptr<double>();
        for (int64_t i = 0; i < n; ++i)
            model_->stage_inputs(ctx(), *mbs[size_t(i)], sc, slots + i * words);
        if (exchange_) exchange_->clear_over_budget(ctx());
        pipeline_->enqueue(ctx(), sc, n, slots, sums);
        if (s_redo_veto_ >= 0 && exchange_) {
            // Rows over the receive budget on any stage: the pass again, every stage's experts
            // in token chunks.
            gather_redo_flags();
            if (read_redo_flags()[1] != 0) {
                const MoeRedo redo_mode(*model_);
                pipeline_->enqueue(ctx(), sc, n, slots, sums);
            }
        }
        return read_staged_losses(sums, mbs);
    }

    int64_t graph_captures() const override {
        return captures_ + (chunks_ ? chunks_->captures() : 0);
    }
    int64_t pipeline_recomputed() const override { return pipeline_ ? pipeline_->recomputed() : 0; }

    void stage_inputs(const MicroBatch& mb, const LossScales& scales, Comm* cp_group) override {
        ST_CHECK(!pipeline_,
                 "sparsetron bench times one GPU's whole model: run it with "
                 "pipeline_model_parallel_size: 1");
        ST_CHECK(!cp_group || dynamic_cp_, "a micro-batch's own CP group is dynamic CP's");
        if (dynamic_cp_) model_->set_context_parallel(cp_group);
        model_->load_inputs(ctx(), mb, scales);
    }

    double timed_step(BenchMode mode, bool optimizer, const LossScales& scales,
                      int64_t micro_batches, int64_t step) override {
        const RunConfig& run = recipe_.run;
        // The model's chunk graphs for this mode only (the recipe's setting after it).
        struct Chunks {
            CudaEngine& e;
            ~Chunks() {
                e.set_chunk_graphs(e.recipe_.run.cuda_graph_impl == "local");
                if (e.chunks_)
                    e.chunks_->set_capturing(e.chunk_steps_ >
                                             e.recipe_.run.cuda_graph_warmup_steps);
            }
        } restore{*this};
        set_chunk_graphs(mode == BenchMode::Local);
        // The chunks are captured from the mode's second run (the first makes the GEMM plans).
        if (chunks_) chunks_->set_capturing(mode == BenchMode::Local && bench_local_runs_ > 0);
        if (mode == BenchMode::Local) ++bench_local_runs_;
        const bool graph = mode == BenchMode::Graph;
        auto enqueue = [&] {
            begin_step(false);
            for (int64_t i = 0; i < micro_batches; ++i) {
                if (i + 1 == micro_batches) begin_reduce();
                model_->enqueue(ctx(), scales);
            }
            end_backward();
            if (optimizer) opt_->enqueue_step(ctx(), run);
        };
        if (optimizer) opt_->stage_schedule(ctx(), run, step);
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

    double planned_memory_mib() const override {
        const double region = exchange_ ? double(exchange_->device_bytes()) : 0.0;
        return (double(plan_.total_bytes()) + region) / (1024.0 * 1024.0);
    }

  private:
    // Chunk-wise graphs (cuda_graph_impl: local) on or off: the model's layers and head as
    // chunks, the gradients in accumulate-only mode.
    void set_chunk_graphs(bool on) {
        if (on && !chunks_) chunks_ = std::make_unique<cuda::ChunkGraphs>(session_);
        model_->set_chunk_graphs(on ? chunks_.get() : nullptr);
        chunked_ = on;
    }
    // Data parallelism: gradients and routing statistics summed over the ranks. With
    // overlap_grad_reduce the step's last micro-batch reduces each bucket (the gradient ranges
    // complete at one backward point, model/cuda/glm5_model.h) on a side stream as soon as its
    // backward point passes, overlapping the rest of the backward; finish_reduce() reduces what is
    // left (all of it without overlap, or a forward-only step), then the main stream waits for the
    // side stream before clipping reads the gradients.
    void plan_buckets() {
        const auto& params = model_->params().params();
        struct Entry {
            char* grad;
            int64_t n;
            bool bf16;  // a bf16 gradient buffer (grad_reduce_in_bf16), else fp32
            int point;
            Comm* over;  // dense: every rank; sharded experts: their EDP group (none: null)
        };
        std::vector<Entry> all;
        for (size_t i = 0; i < params.size(); ++i) {
            const cuda::CudaParam& g = model_->cuda_params()[int64_t(i)];
            Comm* over = params[i].routed_expert ? edp_ : dp_;
            if (g.has_grad())
                all.push_back({static_cast<char*>(g.grad_out()), g.numel, g.grad16 != nullptr,
                               model_->backward_point(params[i].name), over});
        }
        std::sort(all.begin(), all.end(),
                  [](const Entry& a, const Entry& b) { return a.grad < b.grad; });
        buckets_.assign(size_t(model_->backward_points()), {});
        // Neighbours in the arena that complete at the same point, reduce over the same group
        // and have one type form one range (the gap between them is alignment padding, zeroed
        // with the gradients).
        for (size_t i = 0; i < all.size();) {
            size_t j = i + 1;
            while (j < all.size() && all[j].point == all[i].point && all[j].over == all[i].over &&
                   all[j].bf16 == all[i].bf16)
                ++j;
            const int64_t elem = all[i].bf16 ? 2 : 4;
            const char* end = all[j - 1].grad + all[j - 1].n * elem;
            if (all[i].over)
                buckets_[size_t(all[i].point)].push_back(
                    {all[i].grad, int64_t(end - all[i].grad) / elem, all[i].bf16, all[i].over});
            i = j;
        }
    }
    void reduce_point(int p) {
        if (fired_[size_t(p)]) return;
        fired_[size_t(p)] = true;
        if (buckets_[size_t(p)].empty()) return;
        void* stream = ctx().stream;
        if (side_) side_->fork(), stream = side_->stream();
        for (const Bucket& b : buckets_[size_t(p)])
            if (b.bf16)
                b.over->device_allreduce_sum_bf16(b.grad, b.n, stream);
            else
                b.over->device_allreduce_sum(reinterpret_cast<float*>(b.grad), b.n, stream);
    }
    void begin_reduce() {
        if (!dp_) return;
        fired_.assign(buckets_.size(), false);
        if (side_) model_->set_backward_hook([this](int p) { reduce_point(p); });
    }
    void finish_reduce() {
        if (!dp_) return;
        model_->set_backward_hook(nullptr);
        if (fired_.size() != buckets_.size()) fired_.assign(buckets_.size(), false);
        for (int p = 0; p < int(buckets_.size()); ++p) reduce_point(p);
        void* stream = ctx().stream;
        if (side_) side_->fork(), stream = side_->stream();
        for (auto [stats, n] : model_->moe_stat_buffers())
            dp_->device_allreduce_sum(stats, n, stream);
        if (side_) side_->join();
        fired_.clear();
    }
    // The losses of a step's micro-batches from their staged sums (step_staging.h: per
    // micro-batch a row per stage the model holds, added here).
    std::vector<LossSums> read_staged_losses(const double* sums,
                                             const std::vector<const MicroBatch*>& mbs) const {
        const size_t n = mbs.size(), ns = size_t(model_->n_sums()),
                     chunks = model_->stages().size();
        std::vector<double> host(n * chunks * ns), mb(ns);
        cuda::download(ctx(), host.data(), sums, int64_t(host.size() * sizeof(double)));
        std::vector<LossSums> out;
        for (size_t i = 0; i < n; ++i) {
            std::fill(mb.begin(), mb.end(), 0.0);
            for (size_t c = 0; c < chunks; ++c)
                for (size_t j = 0; j < ns; ++j) mb[j] += host[(i * chunks + c) * ns + j];
            out.push_back(model_->losses_from(mb.data(), *mbs[i]));
        }
        return out;
    }
    // Whether any rank's routing went over the receive budget since the flag was cleared (a
    // collective over the stage's ranks; synchronizes).
    bool over_budget_anywhere() {
        if (!exchange_) return false;
        if (dp_) dp_->device_allreduce_max(exchange_->over_budget(), 1, ctx().stream);
        int32_t flag = 0;
        cuda::download(ctx(), &flag, exchange_->over_budget(), sizeof flag);
        return flag != 0;
    }
    // The stash's use and the receive budget's flag after a step (synchronizes).
    void read_moe_use(StepOutcome& out) const {
        out.stash = stash_use();
        if (s_redo_veto_ >= 0) {  // any stage's overflow
            const std::array<int32_t, 2> flags = read_redo_flags();
            out.stash.overflow = flags[0] != 0;
            out.over_budget = flags[1] != 0;
        } else if (exchange_) {
            int32_t flag = 0;
            cuda::download(ctx(), &flag, exchange_->over_budget(), sizeof flag);
            out.over_budget = flag != 0;
        }
    }
    StashUse stash_use() const {
        StashUse u;
        if (const cuda::MoeStash* st = model_->moe_stash()) {
            const cuda::MoeStash::Use d = st->read(ctx());
            u.pool_pages = d.pool_pages, u.page_rows = d.page_rows, u.peak_pages = d.peak_pages;
            u.demand_pages = d.demand_pages, u.overflow = d.overflow;
            u.balanced_pages = st->bound().balanced_pages;
        }
        return u;
    }
    // What a captured training step depends on besides buffer contents.
    struct GraphSignature {
        int64_t micro_batches = 0;
        bool backward = false, indexer_grads = false, indexer_loss = false;
        int64_t mtp_scales = 0;
        bool operator!=(const GraphSignature& o) const {
            return micro_batches != o.micro_batches || backward != o.backward ||
                   indexer_grads != o.indexer_grads || indexer_loss != o.indexer_loss ||
                   mtp_scales != o.mtp_scales;
        }
        std::string describe() const {
            return cat(micro_batches, " micro-batches", backward ? "" : ", forward only",
                       indexer_grads ? ", indexer gradients" : "");
        }
    };
    const ExecContext& ctx() const { return session_.ctx(); }
    // Every optimizer state tensor of the device, its host mirror (matched by checkpoint name)
    // and where in the mirror it lies (a parameter split by rows: this rank's rows).
    struct StatePair {
        MemoryPlan::Slot device, host;
        size_t offset;
    };
    std::vector<StatePair> state_pairs() const {
        std::map<std::string, MemoryPlan::Slot> host;
        for (auto& [name, slot] : host_optimizer_.state_tensors()) host[name] = slot;
        std::vector<StatePair> out;
        for (auto& [name, slot] : opt_->state_tensors()) {
            auto it = host.find(name);
            ST_CHECK(it != host.end(), "optimizer state '", name, "' has no host mirror");
            const int64_t param = host_store_.index_of(name.substr(0, name.rfind('.')));
            ST_ASSERT(param >= 0, "optimizer state '", name, "' has no parameter");
            const size_t first = size_t(model_->cuda_params()[param].first);
            out.push_back({slot, it->second, first * sizeof(float)});
        }
        return out;
    }

    Recipe recipe_;
    const ParamStore& host_store_;
    const MemoryPlan& host_plan_;
    const Optimizer& host_optimizer_;
    Communicators comms_;
    Comm* dp_ = nullptr;
    OptimizerShard shard_;  // the distributed optimizer: each parameter's owner
    Comm* edp_ = nullptr;   // the sharded experts' gradient group (null: nothing to reduce)
    struct Bucket {
        char* grad;
        int64_t n;  // elements
        bool bf16;  // bf16 elements (bf16 gradient buffers), else fp32
        Comm* over;
    };
    std::vector<std::vector<Bucket>> buckets_;  // per backward point
    std::vector<bool> fired_;
    std::unique_ptr<cuda::SideStream> side_;  // overlap_grad_reduce
    cuda::CudaSession session_;
    MemoryPlan plan_;
    std::unique_ptr<cuda::CudaGlm5Model> model_;
    std::unique_ptr<cuda::CudaOptimizer> opt_;
    std::unique_ptr<cuda::ExpertExchange> exchange_;  // expert parallelism
    std::unique_ptr<CudaPipeline> pipeline_;          // pipeline parallelism
    Comm* embedding_ = nullptr;               // the first and last stages' embedding pair (MTP)
    bool graphs_ = false;                     // cuda_graph_impl full_iteration
    std::unique_ptr<cuda::StepGraph> graph_;  // timed_step's graph (bench)
    // Training graphs (cuda_graph_impl full_iteration): staging slots, the captured step.
    int64_t slots_ = 0, captures_ = 0;
    std::unique_ptr<cuda::ChunkGraphs> chunks_;  // cuda_graph_impl local (or bench's "local")
    bool chunked_ = false;
    int64_t chunk_steps_ = 0;       // training steps run with chunk-wise graphs
    int64_t bench_local_runs_ = 0;  // bench's timed steps with chunk-wise graphs
    MemoryPlan::Slot s_slots_ = -1, s_sums_ = -1, s_index_ = -1;
    // Pipeline parallelism with the stash or the receive budget: any rank's overflow of each.
    MemoryPlan::Slot s_redo_veto_ = -1;
    int32_t* redo_veto() const { return plan_.view(s_redo_veto_).ptr<int32_t>(); }
    // The flags after gather_redo_flags() (synchronizes): [0] the stash's, [1] the budget's.
    std::array<int32_t, 2> read_redo_flags() const {
        std::array<int32_t, 2> flags{};
        cuda::download(ctx(), flags.data(), redo_veto(), sizeof flags);
        return flags;
    }
    int64_t eager_steps_ = 0;  // full_iteration's warm-up steps run so far
    std::unique_ptr<cuda::StepGraph> step_graph_;
    GraphSignature step_sig_;
    // Dynamic CP with full_iteration: one micro-batch graph per (CP size, backward, indexer
    // gradients, indexer loss, MTP scales), the step's start and its end.
    bool dynamic_cp_ = false;
    using DynamicGraphKey = std::tuple<int, bool, bool, bool, int64_t>;
    std::map<DynamicGraphKey, WarmGraph> cp_graphs_;
    WarmGraph dcp_start_, dcp_end_;
    std::pair<int64_t, bool> graph_signature_{0, false};
};

}  // namespace

std::unique_ptr<StepEngine> make_cuda_engine(const Recipe& recipe, TrainingPlan& plan,
                                             const Communicators& comms) {
    // Before any CUDA call, so a machine without a GPU gets this message, not a driver error.
    ST_CHECK(cuda_available(), "--device cuda: no CUDA device is visible (",
             "nvidia-smi lists none, or the driver is older than CUDA 13); use --device cpu");
    return std::make_unique<CudaEngine>(recipe, plan, comms);
}

}  // namespace sparsetron
