#include "sparsetron/runtime/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <numeric>

#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/stop_request.h"
#include "sparsetron/data/split.h"
#include "sparsetron/io/checkpoint_identity.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/io/rank_processes.h"
#include "sparsetron/parallel/comm/collective_watchdog.h"
#include "sparsetron/parallel/layout/layout.h"
#include "sparsetron/runtime/host_memory_check.h"
#include "sparsetron/runtime/run_setup.h"

namespace fs = std::filesystem;

namespace sparsetron {
namespace {

// The step's MoE applications routed more rows than the paged stash holds: the engine ran it
// again eagerly without the stash; say which bound would keep such steps in the graph.
std::string stash_overflow_message(const ModelConfig& mc, const StashUse& u, int64_t step) {
    const double f = mc.moe_paged_stash_buffer_size_factor_cuda;
    if (u.balanced_pages == 0)  // this rank's pipeline stage holds no MoE layer
        return cat("MoE paged stash overflow at step ", step,
                   " on another pipeline stage: the step ran again eagerly without the stash on "
                   "every stage (moe_stash_redos in the metrics counts such steps); raise "
                   "moe_paged_stash_buffer_size_factor_cuda (now ",
                   f, ") to keep such steps in the graph");
    // pool = ceil(factor x balanced pages) >= demand.
    const double need = std::ceil(100.0 * double(u.demand_pages) / double(u.balanced_pages)) / 100;
    return cat("MoE paged stash overflow at step ", step, ": the step's MoE layers needed ",
               u.demand_pages, " pages of ", u.page_rows, " rows at once, the pool holds ",
               u.pool_pages, " (moe_paged_stash_buffer_size_factor_cuda ", f,
               "); the step ran again eagerly without the stash (moe_stash_redos in the "
               "metrics counts such steps). moe_paged_stash_buffer_size_factor_cuda ",
               need, " or more would have held it");
}

// The step's routing sent some expert-parallel rank more rows than its receive budget: the engine
// ran it again eagerly in token chunks; say what the factor bounds and what raising it costs.
std::string budget_overflow_message(const ModelConfig& mc, int64_t step) {
    return cat("MoE expert-parallel receive budget exceeded at step ", step,
               ": a rank's routing sent another rank's experts more rows than "
               "moe_expert_rank_capacity_factor ",
               mc.moe_expert_rank_capacity_factor,
               " allows; the step ran again eagerly with the routed experts in token chunks "
               "(moe_budget_redos in the metrics counts such steps). A larger factor keeps "
               "such steps in one pass and plans more receive rows "
               "(`sparsetron plan --device cuda` shows them)");
}

void check_supported(const Recipe& r, const TrainOptions& o) {
    check_fp8_recipe(r.run, o.device, r.model.fp8_output_proj);
    const int ranks = o.comm ? o.comm->size() : 1;
    ST_CHECK(r.run.world_size == ranks, "world_size ", r.run.world_size, " but ", ranks,
             ranks == 1 ? " process was started (launch N processes with mpirun -np N, or set "
                          "world_size: 1)"
                        : " processes were started");
    if (ranks == 1) return;
    ST_CHECK(o.device == Device::CPU || o.comm->on_device(),
             "multi-process training on CUDA needs ",
             "the NCCL communicator (run `sparsetron`, not sparsetron-mpi, under the launcher); ",
             "this one is ", o.comm->name());
    ST_CHECK(r.run.tensor_model_parallel_size == 1,
             "tensor parallelism is not implemented (tensor_model_parallel_size must be 1)");
    if (r.run.dynamic_context_parallel) {
        ST_CHECK(r.run.max_seqlen_per_dp_cp_rank > 0,
                 "dynamic_context_parallel needs max_seqlen_per_dp_cp_rank (tokens per rank)");
        ST_CHECK(r.run.sequence_packing_scheduler == "default_dynamic_cp",
                 "dynamic_context_parallel needs sequence_packing_scheduler: default_dynamic_cp");
    }
}

}  // namespace

Trainer::Trainer(Recipe recipe, TrainOptions options)
    : recipe_(std::move(recipe)), options_(std::move(options)) {
    check_supported(recipe_, options_);
    if (world_size() > 1) {
        check_same_on_all_ranks(*options_.comm, recipe_.to_yaml(), "recipe");
        // Heartbeats in the output directory name a rank that stops answering when the ranks
        // share it (one --out for the launch).
        CollectiveWatchdog::instance().configure(60.0 * recipe_.run.distributed_timeout_minutes,
                                                 options_.out_dir, options_.comm->rank(),
                                                 options_.comm->size());
    }
    ST_CHECK(!options_.out_dir.empty(), "trainer: no output directory");
    ensure_writable_dir(options_.out_dir);
    write_rank_process(options_.out_dir, world_rank());  // for `sparsetron stop`
    // One run per output directory and per save directory (rank 0 holds the locks for the
    // launch); saves that a killed run left half-done are removed, the complete checkpoints are
    // not touched.
    if (world_rank() == 0) {
        lock_ = std::make_unique<DirectoryLock>(options_.out_dir, "output directory");
        if (options_.save_checkpoints) {
            ensure_writable_dir(checkpoint_dir());
            if (fs::weakly_canonical(checkpoint_dir()) != fs::weakly_canonical(options_.out_dir))
                save_lock_ = std::make_unique<DirectoryLock>(checkpoint_dir(), "save directory");
        }
        remove_stale_temporaries(checkpoint_dir());
    }
    // Data first: a bad dataset fails before any memory is planned.
    open_data();
    const RunConfig& r = recipe_.run;
    // Expert parallelism shards the routed experts: this rank's model holds its EP rank's.
    // Pipeline parallelism: it holds its stage's layers.
    const ParallelLayout layout = make_layout(r, world_size());
    if (r.expert_model_parallel_size > 1)
        recipe_.model.expert_parallel_rank = layout.ep_rank(world_rank());
    if (r.pipeline_model_parallel_size > 1)
        stages_ = pipeline_rank_stages(recipe_.model, r, layout.pp_rank(world_rank()));
    // On CPU every planned byte is host memory: a model that cannot fit stops before planning.
    if (options_.device == Device::CPU) check_host_memory_for_training(recipe_);
    tp_ = make_training_plan(recipe_, options_.device, stages_);
    // Expert, context and pipeline parallelism: the layout's communicators, made once; the MoE
    // layers exchange rows over the EP group (MPI on CPU ranks, the GPUs' peer memory on CUDA),
    // the attention gathers keys over the CP group, stages pass activations over the pipeline.
    if (r.expert_model_parallel_size > 1 || r.context_parallel_size > 1 ||
        r.pipeline_model_parallel_size > 1 || (r.dynamic_context_parallel && world_size() > 1))
        groups_ = std::make_unique<ProcessGroups>(ProcessGroups::create(*options_.comm, layout));
    engine_ = options_.device == Device::CUDA ? make_cuda_engine(recipe_, *tp_, communicators())
                                              : make_cpu_engine(recipe_, *tp_, communicators());
    const int64_t slots = r.tokens_per_microbatch();
    packer_ = std::make_unique<Packer>(*stream_, slots, tp_->max_documents);
    if (valid_stream_)
        valid_packer_ = std::make_unique<Packer>(*valid_stream_, slots, tp_->max_documents);
    // microbatches_per_step() is per data-parallel rank: every rank packs the whole step's
    // micro-batches (the same sequence) and runs its share (with CP, a CP group shares each).
    const int64_t step_batches = r.microbatches_per_step() * data_parallel_size();
    check_host_memory_for_batches(recipe_, step_batches, slots, tp_->max_documents);
    for (int64_t i = 0; i < step_batches; ++i) batches_.emplace_back(slots, tp_->max_documents);
    if (r.dynamic_context_parallel)
        dynamic_cp_ = std::make_unique<DynamicCpBatches>(
            r, tp_->group_slots, tp_->group_max_documents, groups_.get(), stage_rank(),
            stage_size(),
            pipeline_virtual_stages(recipe_.model, r) > 1 ? r.pipeline_model_parallel_size : 1);
    load_or_initialize();
    adopt_run_id();
    engine_->upload_state();
}

Trainer::~Trainer() {
    // The engine first: a captured step graph holds NCCL operations on the process groups'
    // communicators (CP), and destroying a communicator a live graph uses hangs at exit.
    engine_.reset();
}

Communicators Trainer::communicators() const {
    Communicators c;
    c.world = world_size() > 1 ? options_.comm : nullptr;
    c.stage = world_size() > 1 ? stage_comm() : nullptr;
    if (!groups_) return c;
    c.expert = groups_->ep.get();
    c.context = groups_->cp.get();
    c.expert_data = groups_->edp.get();
    c.pipeline = groups_->pp.get();
    if (c.pipeline) c.embedding = groups_->embedding.get();
    return c;
}

void Trainer::open_data() {
    const RunConfig& r = recipe_.run;
    // Rank 0 prepares the bundled corpus (a file write) before the other ranks read it.
    std::vector<std::string> data_paths;
    if (world_rank() == 0) data_paths = resolve_data_path(r, options_.out_dir);
    if (world_size() > 1) {
        char ready = 1;
        options_.comm->broadcast(&ready, 1, 0);
        if (world_rank() != 0) data_paths = resolve_data_path(r, options_.out_dir);
    }
    const std::array<double, 3> split = parse_split(r.split);
    stream_ = std::make_unique<DocumentStream>(data_paths, static_cast<uint64_t>(r.seed),
                                               DataPart::Train, split);
    ST_CHECK(stream_->max_token_id() < recipe_.model.vocab_size, "the dataset holds token id ",
             stream_->max_token_id(), " but vocab_size is ", recipe_.model.vocab_size);
    if (split[1] > 0 && r.eval_iters > 0 && r.eval_interval > 0) {
        ST_CHECK(!r.dynamic_context_parallel,
                 "validation (split with a valid part, eval_interval > 0) does not run under "
                 "dynamic_context_parallel yet: set eval_interval: 0, or validate the checkpoints "
                 "with `sparsetron eval --data`");
        valid_stream_ = std::make_unique<DocumentStream>(data_paths, static_cast<uint64_t>(r.seed),
                                                         DataPart::Valid, split);
        ST_CHECK(valid_stream_->max_token_id() < recipe_.model.vocab_size,
                 "the validation documents hold token id ", valid_stream_->max_token_id(),
                 " but vocab_size is ", recipe_.model.vocab_size);
    }
}

void Trainer::load_or_initialize() {
    const RunConfig& r = recipe_.run;
    state_.seed = static_cast<uint64_t>(r.seed);
    std::string resume = options_.resume_dir.empty() ? r.load : options_.resume_dir;
    pretrained_from_ = pretrained_weights_dir(r, options_.resume_dir);
    if (!pretrained_from_.empty()) resume.clear();
    if (!resume.empty()) {
        std::string ckpt = resolve_checkpoint(resume);
        check_checkpoint_weights_kept(ckpt, recipe_.model);
        load_model_weights(ckpt, *tp_->params, tp_->plan);
        load_optimizer_state(ckpt, *tp_->params, *tp_->optimizer, tp_->plan);
        state_ = load_trainer_state(ckpt);
        last_saved_ = state_.iteration;
        ST_CHECK(state_.seed == uint64_t(r.seed), ckpt, "/trainer_state.json: seed ", state_.seed,
                 " but the recipe's seed is ", r.seed,
                 ": resume with the checkpoint's (--set seed=", state_.seed, ")");
        try {
            stream_->set_position(StreamPosition::from_json(state_.data_position));
        } catch (const Error& e) {
            throw Error(cat(ckpt, "/trainer_state.json: ", e.what()));
        }
        return;
    }
    tp_->params->initialize(tp_->plan, state_.seed, recipe_.model.init_method_std,
                            recipe_.model.num_layers);
    if (pretrained_from_.empty()) return;
    check_pretrained_config(pretrained_from_, recipe_.model);
    initialized_ = load_pretrained_weights(pretrained_from_, *tp_->params, tp_->plan);
}

void Trainer::adopt_run_id() {
    // A resumed run keeps its id (retention then bounds what its earlier parts saved); a fresh
    // one, or one resumed from a checkpoint without an id, takes rank 0's new one.
    if (!state_.run_id.empty()) return;
    std::string id = new_run_id();
    if (world_size() > 1) options_.comm->broadcast(id.data(), int64_t(id.size()), 0);
    state_.run_id = id;
}

std::string Trainer::checkpoint_dir() const {
    return recipe_.run.save.empty() ? (fs::path(options_.out_dir) / "checkpoints").string()
                                    : recipe_.run.save;
}

std::vector<MicroBatch> Trainer::peek_next_step_batches() {
    StreamPosition saved = stream_->position();
    std::vector<MicroBatch> out = batches_;
    for (auto& mb : out) packer_->next(mb);
    stream_->set_position(saved);
    return out;
}

LossScales Trainer::step_scales(const StepMetrics& m, int64_t& chain_rows) const {
    const ModelConfig& mc = recipe_.model;
    const int64_t D = mc.mtp_num_layers;
    const bool tv = mc.mtp_loss_type == "e2e_tv";
    // Per-token normalization across micro-batches (SPEC §6): count every loss's rows first.
    std::vector<int64_t> mtp_rows(size_t(mtp_loss_slots(mc)), 0);
    for (const auto& mb : batches_) add_mtp_rows(mc, mb, mtp_rows);
    const bool warmup = recipe_.run.dsa_dense_warmup;
    LossScales sc;
    sc.backward = !warmup;  // dense warm-up: forward only; the indexer's gradient comes from it
    sc.indexer_grads = warmup;
    sc.lm = 1.0 / double(m.targets);
    const double lambda = mc.mtp_loss_scaling_factor;
    for (size_t k = 0; k < mtp_rows.size(); ++k) {
        double rows = std::max<int64_t>(1, mtp_rows[k]);
        sc.mtp.push_back(tv ? lambda / rows : lambda / double(D) / rows);
    }
    chain_rows = tv && D > 0 ? mtp_rows[0] : 0;  // e2e_tv: the acceptance length's rows
    // Per-micro-batch losses (indexer, aux) are averaged over the micro-batches the step runs:
    // under dynamic CP over its groups (every rank's). Per-token loss (Megatron's
    // calculate_per_token_loss, required by dynamic CP): the indexer's KL summed over the global
    // batch's rows and divided by its loss tokens, as the LM loss is.
    int64_t runs = int64_t(batches_.size());
    if (!m.dynamic_cp_groups.empty())
        runs = std::accumulate(m.dynamic_cp_groups.begin(), m.dynamic_cp_groups.end(), int64_t(0));
    sc.indexer = 1.0 / double(runs);
    if (recipe_.run.calculate_per_token_loss) sc.indexer = 1.0, sc.indexer_tokens = m.targets;
    sc.aux = 1.0 / double(runs);
    return sc;
}

StepMetrics Trainer::train_step() {
    auto t0 = std::chrono::steady_clock::now();
    for (auto& mb : batches_) packer_->next(mb);
    StepMetrics m;
    m.step = state_.iteration + 1;
    for (const auto& mb : batches_) {
        m.targets += mb.num_targets();
        m.tokens += mb.num_tokens;
        for (int64_t d = 0; d < mb.num_documents; ++d)
            m.doc_lengths.push_back(mb.cu_seqlens[size_t(d + 1)] - mb.cu_seqlens[size_t(d)]);
    }
    ST_CHECK(m.targets > 0, "step ", m.step, " has no loss targets (documents of one token?)");
    // This rank's micro-batches (all of them without data parallelism; the CP ranks of one
    // data-parallel rank run the same ones, each its rows). Dynamic CP: this rank's groups'
    // micro-batches, each with its CP communicator.
    StepWork work;
    work.update = m.step - state_.skipped_steps;
    if (dynamic_cp_) {
        DynamicCpBatches::Step s = dynamic_cp_->schedule(batches_);
        work.micro_batches = std::move(s.micro_batches);
        work.cp_groups = std::move(s.cp_groups);
        m.dynamic_cp_groups = std::move(s.groups_by_size);
        m.dynamic_cp_idle_ranks = s.idle_ranks;
    } else {
        for (size_t i = 0; i < batches_.size(); ++i)
            if (int(i) % data_parallel_size() == data_parallel_rank())
                work.micro_batches.push_back(&batches_[i]);
    }
    int64_t chain_rows = 0;
    work.scales = step_scales(m, chain_rows);
    StepOutcome o = engine_->run_step(work);
    // The losses summed over every rank: data-parallel ranks ran other micro-batches, CP ranks
    // other rows of the same ones, pipeline stages other layers.
    // lm, mtp, acceptance, indexer, aux, then each layer's indexer term (layers, MTP depths).
    const ModelConfig& mc = recipe_.model;
    std::vector<double> sums(size_t(5 + mc.num_layers + mc.mtp_num_layers), 0.0);
    std::vector<char> has_indexer(size_t(mc.num_layers + mc.mtp_num_layers), 0);
    for (const LossSums& s : o.losses) {
        sums[0] += s.lm_loss_sum;
        for (size_t k = 0; k < s.mtp_sum.size(); ++k) sums[1] += s.mtp_sum[k] * work.scales.mtp[k];
        sums[2] += s.mtp_acceptance_sum;
        sums[3] += s.indexer_loss * work.scales.indexer;
        sums[4] += s.aux_loss;
        for (const auto& [layer, loss] : s.indexer_layers) {
            sums[size_t(5 + layer)] += loss * work.scales.indexer;
            has_indexer[size_t(layer)] = 1;
        }
    }
    if (world_size() > 1) {
        options_.comm->allreduce_sum(sums.data(), int64_t(sums.size()));
        // Which layers have an indexer: every rank's stage (a pipeline's layers are spread).
        std::vector<double> seen(has_indexer.begin(), has_indexer.end());
        options_.comm->allreduce_sum(seen.data(), int64_t(seen.size()));
        for (size_t l = 0; l < seen.size(); ++l) has_indexer[l] = seen[l] > 0;
    }
    for (size_t l = 0; l < has_indexer.size(); ++l)
        if (has_indexer[l]) m.indexer_loss_layers.emplace_back(int64_t(l), sums[5 + l]);
    m.lm_loss = sums[0] / double(m.targets);
    m.mtp_loss = sums[1];
    if (chain_rows > 0) m.mtp_acceptance_length = sums[2] / double(chain_rows);
    // Megatron logs the indexer loss summed over layers and divided by num_layers; the objective
    // adds the sum.
    m.indexer_loss = sums[3] / double(mc.num_layers);
    m.aux_loss = sums[4];
    m.total_loss = m.lm_loss + m.mtp_loss + sums[3] + m.aux_loss;
    m.moe_load = std::move(o.moe_load);
    m.moe_dropped = o.moe_dropped;
    m.graph = o.replayed;
    m.moe_stash_pages = o.stash.pool_pages;
    m.moe_stash_peak_pages = o.stash.peak_pages;
    // The first redo of the run for each reason says why; later ones are counted in the metrics.
    if (o.redone && o.stash.overflow) {
        m.moe_stash_redo = true;
        if (stash_redos_++ == 0 && world_rank() == 0)
            std::cerr << "warning: " << stash_overflow_message(recipe_.model, o.stash, m.step)
                      << "\n";
    }
    if (o.redone && o.over_budget) {
        m.moe_budget_redo = true;
        if (budget_redos_++ == 0 && world_rank() == 0)
            std::cerr << "warning: " << budget_overflow_message(recipe_.model, m.step) << "\n";
    }
    m.moe_stash_redos = stash_redos_;
    m.moe_budget_redos = budget_redos_;
    m.lr = o.stats.lr;
    m.grad_norm = o.stats.grad_norm;
    m.grad_norm_mtp = o.stats.grad_norm_mtp;
    m.skipped = o.stats.skipped;
    state_.iteration = m.step;
    state_.consumed_tokens += m.tokens;
    if (o.stats.skipped) ++state_.skipped_steps;
    m.step_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return m;
}

std::string Trainer::save() {
    last_saved_ = state_.iteration;
    // Every rank's state to its host plan (gathered from the owners under a distributed
    // optimizer): rank 0 writes, or with sharded experts one rank per EP rank.
    engine_->download_state();
    state_.data_position = stream_->position().to_json();
    if (groups_ && (recipe_.run.expert_model_parallel_size > 1 || groups_->pp)) {
        // Sharded experts or stages: the first EP group's ranks of each stage write a shard each
        // (its first rank's with the stage's dense tensors), the replicas nothing.
        const ParallelLayout& l = groups_->layout;
        const int me = world_rank();
        CheckpointShards shards{options_.comm,
                                l.edp_rank(me) == 0 ? l.pp_rank(me) * l.ep + l.ep_rank(me) : -1,
                                l.pp * l.ep, l.ep_rank(me) == 0};
        return save_checkpoint(checkpoint_dir(), {recipe_.run.save_keep_last, state_.run_id},
                               recipe_.model, recipe_.to_yaml(), *tp_->params, tp_->plan,
                               tp_->optimizer.get(), state_, &shards);
    }
    if (world_rank() != 0) return checkpoint_dir();
    return save_checkpoint(checkpoint_dir(), {recipe_.run.save_keep_last, state_.run_id},
                           recipe_.model, recipe_.to_yaml(), *tp_->params, tp_->plan,
                           tp_->optimizer.get(), state_);
}

std::optional<StepMetrics::Valid> Trainer::validate() {
    if (!valid_stream_) return std::nullopt;
    const RunConfig& r = recipe_.run;
    const ModelConfig& mc = recipe_.model;
    const size_t n = size_t(valid_stream_->num_datasets());
    valid_stream_->set_position(StreamPosition{
        std::vector<int64_t>(n, 0), std::vector<int64_t>(n, 0), std::vector<int64_t>(n, 0)});
    LossScales sc;
    sc.backward = false;
    sc.lm = 1.0;
    sc.mtp.assign(size_t(mtp_loss_slots(mc)), 1.0);
    std::vector<MicroBatch> batches = batches_;
    // Raw sums over every micro-batch of every rank: [lm, mtp per slot...].
    std::vector<double> sums(1 + sc.mtp.size(), 0.0);
    int64_t targets = 0;
    std::vector<int64_t> mtp_rows(sc.mtp.size(), 0);
    StepMetrics::Valid v;
    for (int64_t it = 0; it < r.eval_iters; ++it) {
        for (auto& mb : batches) valid_packer_->next(mb);
        std::vector<const MicroBatch*> mine;
        for (size_t i = 0; i < batches.size(); ++i) {
            const MicroBatch& mb = batches[i];
            targets += mb.num_targets();
            add_mtp_rows(mc, mb, mtp_rows);
            // The same share as a training step: data-parallel rank i % DP (its CP group's
            // ranks each their rows; EP ranks exchange inside the forward).
            if (int(i) % data_parallel_size() == data_parallel_rank()) mine.push_back(&mb);
        }
        for (const LossSums& s : engine_->forward_only(mine, sc)) {
            sums[0] += s.lm_loss_sum;
            for (size_t k = 0; k < s.mtp_sum.size() && k < sc.mtp.size(); ++k)
                sums[1 + k] += s.mtp_sum[k];
        }
        v.micro_batches += int64_t(batches.size());
    }
    if (world_size() > 1) options_.comm->allreduce_sum(sums.data(), int64_t(sums.size()));
    ST_CHECK(targets > 0, "validation: its documents give no loss targets");
    v.targets = targets;
    v.lm_loss = sums[0] / double(targets);
    v.mtp_loss = reported_mtp_loss(mc, std::vector<double>(sums.begin() + 1, sums.end()), mtp_rows);
    return v;
}

Trainer::End Trainer::run(const std::function<void(const StepMetrics&)>& on_step) {
    const RunConfig& r = recipe_.run;
    const auto start = std::chrono::steady_clock::now();
    int64_t skipped_in_a_row = 0;
    while (state_.iteration < r.train_iters) {
        StepMetrics m = train_step();
        if (valid_stream_ &&
            (state_.iteration % r.eval_interval == 0 || state_.iteration == r.train_iters))
            m.valid = validate();
        if (on_step) on_step(m);
        skipped_in_a_row = m.skipped ? skipped_in_a_row + 1 : 0;
        // A diverged run skips every step: stop, without saving its state, rather than finish.
        if (r.skipped_iters_limit > 0 && skipped_in_a_row >= r.skipped_iters_limit) {
            const int64_t first = m.step - skipped_in_a_row + 1;
            // The weights that gave step `first` its non-finite gradients come from step
            // first - 1's update: only a checkpoint before that holds weights from before it.
            const std::string advice =
                last_saved_ >= 0 && last_saved_ < first - 1
                    ? cat("resume from the checkpoint of iteration ", last_saved_, " (in ",
                          checkpoint_dir(), ") with a lower lr, or check the data")
                    : std::string(
                          "no checkpoint of this run precedes it: start again with a "
                          "lower lr, or check the data");
            throw Error(cat(skipped_in_a_row, " consecutive steps (", first, "..", m.step,
                            ") were skipped for non-finite gradients: the run diverged and stops "
                            "(skipped_iters_limit ",
                            r.skipped_iters_limit, "); ", advice));
        }
        const bool last = state_.iteration == r.train_iters;
        const bool scheduled =
            (r.save_interval > 0 && state_.iteration % r.save_interval == 0) || last;
        End end = stop_after_this_step(start);
        if (options_.save_checkpoints && (scheduled || end.kind != End::Finished)) save();
        // A signal ends every rank with a non-zero code, and mpirun ends the other ranks as soon
        // as one such rank exits: none leaves before the save is complete on every rank.
        if (end.kind == End::Signal && world_size() > 1) options_.comm->allgather(0);
        if (end.kind != End::Finished) return end;
    }
    return {};
}

Trainer::End Trainer::stop_after_this_step(std::chrono::steady_clock::time_point start) const {
    const RunConfig& r = recipe_.run;
    // Every rank stops after the same step: one rank's signal (or clock) counts for all.
    double votes[3] = {
        r.exit_signal_handler ? double(stop_request()) : 0.0,
        r.exit_interval > 0 && state_.iteration % r.exit_interval == 0 ? 1.0 : 0.0,
        r.exit_duration_in_mins > 0 &&
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >=
                    60.0 * r.exit_duration_in_mins
            ? 1.0
            : 0.0};
    if (world_size() > 1) {
        for (double& v : votes) v = v > 0 ? 1.0 + v : 0.0;  // keep the signal number in a sum
        std::vector<uint64_t> all = options_.comm->allgather(
            uint64_t(votes[0]) | uint64_t(votes[1]) << 8 | uint64_t(votes[2]) << 16);
        votes[0] = votes[1] = votes[2] = 0;
        for (uint64_t a : all) {
            votes[0] = std::max(votes[0], double(a & 0xFF) - 1);
            votes[1] = std::max(votes[1], double((a >> 8) & 0xFF));
            votes[2] = std::max(votes[2], double((a >> 16) & 0xFF));
        }
    }
    End end;
    if (votes[0] > 0)
        end.kind = End::Signal, end.signal = int(votes[0]);
    else if (votes[1] > 0)
        end.kind = End::ExitInterval;
    else if (votes[2] > 0)
        end.kind = End::ExitDuration;
    return end;
}

}  // namespace sparsetron
