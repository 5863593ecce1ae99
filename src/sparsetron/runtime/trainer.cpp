#include "sparsetron/runtime/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/core/env.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/parallel.h"
#include "sparsetron/core/stop_request.h"
#include "sparsetron/data/byte_tokenizer.h"
#include "sparsetron/io/durable.h"
#include "sparsetron/optim/owner_assignment.h"
#include "sparsetron/parallel/collective_watchdog.h"
#include "sparsetron/parallel/cp_shard.h"
#include "sparsetron/parallel/dynamic_cp.h"
#include "sparsetron/parallel/layout.h"
#include "sparsetron/runtime/cp_row_plan.h"
#include "sparsetron/runtime/grad_ranges.h"
#include "sparsetron/runtime/host_memory_check.h"
#include "sparsetron/runtime/pipeline_schedule.h"

namespace fs = std::filesystem;

namespace sparsetron {

std::string StepMetrics::to_json() const {
    nlohmann::ordered_json j;
    j["step"] = step;
    j["lm_loss"] = lm_loss;
    j["mtp_loss"] = mtp_loss;
    j["indexer_loss"] = indexer_loss;
    j["aux_loss"] = aux_loss;
    j["total_loss"] = total_loss;
    if (mtp_acceptance_length > 0) j["mtp_acceptance_length"] = mtp_acceptance_length;
    if (!moe_load.empty()) {
        j["moe_load"] = moe_load;
        j["moe_dropped"] = moe_dropped;
    }
    if (moe_stash_pages > 0) {
        j["moe_stash_pages"] = moe_stash_pages;
        j["moe_stash_peak_pages"] = moe_stash_peak_pages;
        j["moe_stash_redos"] = moe_stash_redos;
        if (moe_stash_redo) j["moe_stash_redo"] = true;
    }
    j["lr"] = lr;
    j["grad_norm"] = grad_norm;
    if (grad_norm_mtp > 0) j["grad_norm_mtp"] = grad_norm_mtp;
    j["tokens"] = tokens;
    j["targets"] = targets;
    j["step_ms"] = step_ms;
    j["skipped"] = skipped;
    if (!dynamic_cp_groups.empty()) {
        j["dynamic_cp_groups"] = dynamic_cp_groups;
        j["dynamic_cp_idle_ranks"] = dynamic_cp_idle_ranks;
    }
    if (graph) j["graph"] = true;
    if (valid) {
        j["valid_lm_loss"] = valid->lm_loss;
        if (valid->mtp_loss > 0) j["valid_mtp_loss"] = valid->mtp_loss;
        j["valid_targets"] = valid->targets;
    }
    return j.dump();
}

namespace {

// The step's MoE applications routed more rows than the paged stash holds: the engine ran it
// again eagerly without the stash; say which bound would keep such steps in the graph.
std::string stash_overflow_message(const ModelConfig& mc, const DeviceEngine::StashUse& u,
                                   int64_t step) {
    const double f = mc.moe_paged_stash_buffer_size_factor;
    // pool = ceil(factor x worst case) >= demand.
    const double need =
        std::ceil(100.0 * double(u.demand_pages) / double(u.worst_case_pages)) / 100;
    return cat("MoE paged stash overflow at step ", step, ": the step's MoE layers needed ",
               u.demand_pages, " pages of ", u.page_rows, " rows at once, the pool holds ",
               u.pool_pages, " (moe_paged_stash_buffer_size_factor ", f,
               "); the step ran again eagerly without the stash (moe_stash_redos in the "
               "metrics counts such steps). moe_paged_stash_buffer_size_factor ",
               need, " or more would have held it");
}

}  // namespace

void check_fp8_recipe(const RunConfig& r, Device device) {
    // Never run bf16 silently under an FP8 recipe.
    if (r.fp8_recipe == "mxfp8")
        throw Error(
            "fp8_recipe: mxfp8 is not implemented: its block scaling (32-element UE8M0 scales) "
            "needs Blackwell, and Hopper's cuBLASLt has no MXFP8 GEMM. On Hopper add the overlay "
            "recipes/overlays/h200.yaml (fp8_recipe: blockwise, 1x128 activation / 128x128 "
            "weight scales): --recipe <recipe>,recipes/overlays/h200.yaml; or --set "
            "fp8_recipe= to train in bf16");
    ST_CHECK(r.fp8_recipe.empty() || r.fp8_blockwise(), "fp8_recipe: ", r.fp8_recipe,
             " is not implemented (blockwise is; drop the key to train in bf16)");
    ST_CHECK(r.fp8_recipe.empty() || device == Device::CUDA,
             "fp8_recipe: blockwise trains on CUDA only (the CPU reference model is bf16/fp32; "
             "its FP8 quantizers and GEMM are the references the CUDA ones are tested against): "
             "use --device cuda or drop fp8_recipe");
    ST_CHECK(r.fp8_recipe.empty() || r.fp8_format == "e4m3", "fp8_format: ", r.fp8_format,
             " is not implemented (blockwise uses e4m3 for every operand)");
}

namespace {

// Each pipeline stage's vector, one after another in stage order (the layer order), on every
// rank: this rank's `mine` at its stage's offset (returned in `offset`), the rest zero, summed
// over `sum` (a group spanning the stages: the pipeline group, or every rank, which also adds
// a stage's replicas).
std::vector<double> stages_concatenated(Comm& pp, Comm& sum, const std::vector<double>& mine,
                                        size_t* offset = nullptr) {
    const std::vector<uint64_t> sizes = pp.allgather(uint64_t(mine.size()));
    size_t at = 0, total = 0;
    for (size_t s = 0; s < sizes.size(); ++s) {
        if (int(s) < pp.rank()) at += size_t(sizes[s]);
        total += size_t(sizes[s]);
    }
    std::vector<double> all(total, 0.0);
    std::copy(mine.begin(), mine.end(), all.begin() + std::ptrdiff_t(at));
    sum.allreduce_sum(all.data(), int64_t(all.size()));
    if (offset) *offset = at;
    return all;
}

void check_supported(const Recipe& r, const TrainOptions& o) {
    check_fp8_recipe(r.run, o.device);
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

fs::path find_bundled_corpus() {
    std::vector<fs::path> candidates;
    if (const auto env = env_value("SPARSETRON_DATA_DIR")) candidates.emplace_back(*env);
    candidates.emplace_back(fs::path(SPARSETRON_SOURCE_DIR) / "data" / "corpus");
    candidates.emplace_back(fs::path("data") / "corpus");
    for (const auto& c : candidates)
        if (fs::is_directory(c)) return c;
    throw Error(cat("data_path is empty and the bundled corpus was not found (looked in ",
                    candidates[1].string(), " and ./data/corpus; set SPARSETRON_DATA_DIR)"));
}

}  // namespace

std::string pretrained_weights_dir(const RunConfig& run, const std::string& resume_dir) {
    auto weights_dir = [](const std::string& d) {
        return is_model_dir(d) ? d : resolve_checkpoint(d);
    };
    const std::string load = resume_dir.empty() ? run.load : resume_dir;
    if (!run.pretrained_checkpoint.empty() && load.empty())
        return weights_dir(run.pretrained_checkpoint);
    if (load.empty()) return "";
    if (run.finetune) return weights_dir(load);
    // An HF directory has no training state: its weights start a fresh run.
    if (is_model_dir(load) && !fs::exists(fs::path(load) / "trainer_state.json")) return load;
    return "";
}

void check_pretrained_config(const std::string& dir, const ModelConfig& model) {
    const fs::path config = fs::path(dir) / "config.json";
    if (!fs::exists(config)) return;  // an engine checkpoint's tensors are checked by shape
    const ModelConfig hf = load_hf_config(config.string());
    const std::pair<const char*, std::pair<int64_t, int64_t>> dims[] = {
        {"num_layers", {model.num_layers, hf.num_layers}},
        {"hidden_size", {model.hidden_size, hf.hidden_size}},
        {"num_attention_heads", {model.num_attention_heads, hf.num_attention_heads}},
        {"vocab_size", {model.vocab_size, hf.vocab_size}},
        {"q_lora_rank", {model.q_lora_rank, hf.q_lora_rank}},
        {"kv_lora_rank", {model.kv_lora_rank, hf.kv_lora_rank}},
        {"qk_head_dim", {model.qk_head_dim, hf.qk_head_dim}},
        {"qk_pos_emb_head_dim", {model.qk_pos_emb_head_dim, hf.qk_pos_emb_head_dim}},
        {"v_head_dim", {model.v_head_dim, hf.v_head_dim}},
        {"ffn_hidden_size", {model.ffn_hidden_size, hf.ffn_hidden_size}},
        {"num_experts", {model.num_experts, hf.num_experts}},
        {"moe_ffn_hidden_size", {model.moe_ffn_hidden_size, hf.moe_ffn_hidden_size}},
    };
    for (const auto& [key, v] : dims)
        ST_CHECK(v.first == v.second, config.string(), " has ", key, " ", v.second,
                 " but the recipe has ", v.first,
                 ": train from it with the recipe's value set to the checkpoint's (or without "
                 "--recipe: the model dimensions then come from config.json)");
    // More trained MTP layers than the recipe has would be dropped without a word.
    ST_CHECK(model.mtp_physical_layers() >= hf.mtp_physical_layers(), config.string(), " has ",
             hf.mtp_physical_layers(),
             " distinct MTP layers (num_nextn_predict_layers) but the "
             "recipe trains ",
             model.mtp_physical_layers(),
             ": set mtp_use_repeated_layer: false and mtp_num_layers: ", hf.mtp_num_layers,
             " (or more) to keep them");
}

std::vector<std::string> resolve_data_path(const RunConfig& run, const std::string& out_dir) {
    if (!run.data_path.empty()) return run.data_path;
    fs::path corpus = find_bundled_corpus();
    std::vector<std::string> inputs;
    for (const auto& e : fs::directory_iterator(corpus))
        if (e.path().extension() == ".txt") inputs.push_back(e.path().string());
    std::sort(inputs.begin(), inputs.end());
    ST_CHECK(!inputs.empty(), "the bundled corpus ", corpus.string(), " holds no .txt files");
    fs::path dir = fs::path(out_dir) / "data";
    ensure_writable_dir(dir.string());
    std::string prefix = (dir / "corpus").string();
    if (!fs::exists(prefix + ".idx") || !fs::exists(prefix + ".bin")) {
        PreprocessOptions o;
        o.inputs = inputs;
        o.output_prefix = prefix;
        preprocess(o);
    }
    return {prefix};
}

std::unique_ptr<TrainingPlan> make_training_plan(const Recipe& recipe_in,
                                                 const PipelineStage& stage) {
    auto tp = std::make_unique<TrainingPlan>();
    Recipe recipe = recipe_in;
    const RunConfig& r = recipe.run;
    int64_t slots = r.tokens_per_microbatch();
    if (r.dsa_dense_warmup) {  // SPEC §3.2: attention over every key, the dense indexer loss
        recipe.model.dsa_indexer_topk = std::max(recipe.model.dsa_indexer_topk, slots);
        recipe.model.dsa_indexer_use_sparse_loss = false;
    }
    recipe.model.expert_parallel_ranks = r.expert_model_parallel_size;
    tp->max_documents = r.max_documents_per_microbatch > 0 ? r.max_documents_per_microbatch
                                                           : default_max_documents(slots);
    tp->chunk_rows = r.loss_chunk_rows > 0 ? r.loss_chunk_rows : std::min<int64_t>(slots, 1024);
    // Context parallelism: a rank computes its chunks of every document and attends over every
    // row of the micro-batch (runtime/cp_row_plan.h).
    const CpRowPlan cpp = cp_row_plan(r, slots, tp->max_documents);
    if (r.dynamic_context_parallel)
        tp->group_slots = cpp.slots, tp->group_max_documents = cpp.max_documents;
    tp->chunk_rows = std::min(tp->chunk_rows, cpp.rows);
    tp->model = std::make_unique<Glm5Model<float>>(
        recipe.model, tp->plan, cpp.rows, cpp.max_documents, tp->chunk_rows, cpp.key_rows, stage);
    tp->optimizer =
        std::make_unique<Optimizer>(tp->model->params(), tp->plan, recipe.model, recipe.run);
    return tp;
}

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
    // One run per output directory (rank 0 holds the lock for the launch); saves that a killed
    // run left half-done are removed, the complete checkpoints are not touched.
    if (world_rank() == 0) {
        lock_ = std::make_unique<DirectoryLock>(options_.out_dir);
        remove_stale_temporaries(checkpoint_dir());
    }
    const RunConfig& r = recipe_.run;
    // Data first: a bad dataset fails before any memory is planned. Rank 0 prepares the bundled
    // corpus (a file write) before the other ranks read it.
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
    // Expert parallelism shards the routed experts: this rank's model holds its EP rank's.
    // Pipeline parallelism: it holds its stage's layers.
    const ParallelLayout layout = make_layout(r, world_size());
    if (r.expert_model_parallel_size > 1)
        recipe_.model.expert_parallel_rank = layout.ep_rank(world_rank());
    PipelineStage stage;
    if (r.pipeline_model_parallel_size > 1)
        stage = pipeline_stage(recipe_.model, r, layout.pp_rank(world_rank()));
    // On CPU every planned byte is host memory: a model that cannot fit stops before planning.
    if (options_.device == Device::CPU) check_host_memory_for_training(recipe_);
    tp_ = make_training_plan(recipe_, stage);
    // Expert, context and pipeline parallelism: the layout's communicators, made once; the MoE
    // layers exchange rows over the EP group (MPI on CPU ranks, the GPUs' peer memory on CUDA),
    // the attention gathers keys over the CP group, stages pass activations over the pipeline.
    if (r.expert_model_parallel_size > 1 || r.context_parallel_size > 1 ||
        r.pipeline_model_parallel_size > 1 || (r.dynamic_context_parallel && world_size() > 1))
        groups_ = std::make_unique<ProcessGroups>(ProcessGroups::create(*options_.comm, layout));
    if (options_.device == Device::CUDA) {
        // The host keeps what checkpoints hold; the step's memory is the engine's device plan.
        tp_->plan.allocate_only(Device::CPU, {MemClass::Parameters, MemClass::OptimizerState});
        // With data parallelism over NCCL the engine sums gradients on the device (over the
        // stage's ranks with pipeline parallelism, whose transfers it makes itself).
        const bool pp = groups_ && groups_->pp;
        engine_ = make_cuda_engine(
            recipe_, tp_->model->params(), tp_->plan, *tp_->optimizer, tp_->max_documents,
            tp_->chunk_rows, world_size() > 1 ? stage_comm() : nullptr,
            groups_ ? groups_->ep.get() : nullptr, groups_ ? groups_->cp.get() : nullptr,
            groups_ ? groups_->edp.get() : nullptr, pp ? groups_->pp.get() : nullptr,
            pp ? groups_->embedding.get() : nullptr);
    } else {
        tp_->plan.allocate(Device::CPU);
        tp_->model->bind();
        grad_ranges_ = gradient_ranges(tp_->model->params(), tp_->plan);
        if (groups_ && r.expert_model_parallel_size > 1) {
            tp_->model->set_expert_parallel(groups_->ep.get());
            tp_->optimizer->set_expert_parallel(groups_->ep.get());
        }
        if (groups_ && r.context_parallel_size > 1 && !r.dynamic_context_parallel)
            tp_->model->set_context_parallel(groups_->cp.get());
        if (groups_ && groups_->pp) {
            tp_->optimizer->set_pipeline_parallel(groups_->pp.get());
            pipeline_ = std::make_unique<PipelineSchedule>(*tp_->model, *groups_->pp);
        }
    }
    for (const auto& p : tp_->model->params().params())
        indexer_only_.push_back(p.name.find(".self_attn.indexer.") != std::string::npos);
    const int64_t slots = r.tokens_per_microbatch();
    packer_ = std::make_unique<Packer>(*stream_, slots, tp_->max_documents);
    if (valid_stream_)
        valid_packer_ = std::make_unique<Packer>(*valid_stream_, slots, tp_->max_documents);
    // microbatches_per_step() is per data-parallel rank: every rank packs the whole step's
    // micro-batches (the same sequence) and runs its share (with CP, a CP group shares each).
    for (int64_t i = 0; i < r.microbatches_per_step() * data_parallel_size(); ++i)
        batches_.emplace_back(slots, tp_->max_documents);
    state_.seed = static_cast<uint64_t>(r.seed);

    std::string resume = options_.resume_dir.empty() ? r.load : options_.resume_dir;
    pretrained_from_ = pretrained_weights_dir(r, options_.resume_dir);
    if (!pretrained_from_.empty()) resume.clear();
    if (!resume.empty()) {
        std::string ckpt = resolve_checkpoint(resume);
        load_model_weights(ckpt, tp_->model->params(), tp_->plan);
        load_optimizer_state(ckpt, tp_->model->params(), *tp_->optimizer, tp_->plan);
        state_ = load_trainer_state(ckpt);
        ST_CHECK(state_.seed == uint64_t(r.seed), ckpt, "/trainer_state.json: seed ", state_.seed,
                 " but the recipe's seed is ", r.seed,
                 ": resume with the checkpoint's (--set seed=", state_.seed, ")");
        stream_->set_position(StreamPosition::from_json(state_.data_position));
    } else {
        tp_->model->params().initialize(tp_->plan, state_.seed, recipe_.model.init_method_std,
                                        recipe_.model.num_layers);
        if (!pretrained_from_.empty()) {
            check_pretrained_config(pretrained_from_, recipe_.model);
            initialized_ =
                load_pretrained_weights(pretrained_from_, tp_->model->params(), tp_->plan);
        }
    }
    if (engine_) engine_->upload_state();
    // With one rank the distributed optimizer is the plain one.
    if (r.use_distributed_optimizer && world_size() > 1) {
        // The CUDA engine shards AdamW state by parameter and Muon's work by batch itself.
        if (engine_)
            owner_ = engine_->state_owners();
        else
            assign_owners();
    }
}

double Trainer::memory_gib() const {
    if (engine_) return engine_->memory_in_use_mib() / 1024.0;
    return double(tp_->plan.total_bytes()) / double(1ull << 30);
}

std::string Trainer::device_description() const {
    if (engine_) return "cuda: " + engine_->describe();
    return cat("cpu (", num_threads(), " threads)");
}

Trainer::~Trainer() {
    // The engine first: a captured step graph holds NCCL operations on the process groups'
    // communicators (CP), and destroying a communicator a live graph uses hangs at exit.
    engine_.reset();
}

std::string Trainer::checkpoint_dir() const {
    return recipe_.run.save.empty() ? (fs::path(options_.out_dir) / "checkpoints").string()
                                    : recipe_.run.save;
}

void Trainer::next_step_batches(std::vector<MicroBatch>& out) {
    for (auto& mb : out) packer_->next(mb);
}

std::vector<MicroBatch> Trainer::peek_next_step_batches() {
    StreamPosition saved = stream_->position();
    std::vector<MicroBatch> out = batches_;
    next_step_batches(out);
    stream_->set_position(saved);
    return out;
}

StepMetrics Trainer::train_step() {
    auto t0 = std::chrono::steady_clock::now();
    next_step_batches(batches_);
    StepMetrics m;
    m.step = state_.iteration + 1;
    for (const auto& mb : batches_) {
        m.targets += mb.num_targets();
        m.tokens += mb.num_tokens;
    }
    ST_CHECK(m.targets > 0, "step ", m.step, " has no loss targets (documents of one token?)");
    const ModelConfig& mc = recipe_.model;
    const int64_t D = mc.mtp_num_layers, n_mb = static_cast<int64_t>(batches_.size());
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
    // This rank's micro-batches (all of them without data parallelism; the CP ranks of one
    // data-parallel rank run the same ones, each its rows). Dynamic CP: this rank's groups'
    // micro-batches, each with its CP communicator in `cps`.
    const bool dynamic = recipe_.run.dynamic_context_parallel;
    std::vector<const MicroBatch*> mine;
    std::vector<Comm*> cps;
    if (dynamic) {
        mine = dynamic_cp_batches(cps, m);
    } else {
        for (size_t i = 0; i < batches_.size(); ++i)
            if (int(i) % data_parallel_size() == data_parallel_rank()) mine.push_back(&batches_[i]);
    }
    // Per-micro-batch losses (indexer, aux) are averaged over the micro-batches the step runs:
    // under dynamic CP over its groups (every rank's).
    int64_t runs = n_mb;
    if (dynamic)
        runs = std::accumulate(m.dynamic_cp_groups.begin(), m.dynamic_cp_groups.end(), int64_t(0));
    sc.indexer = 1.0 / double(runs);
    sc.aux = 1.0 / double(runs);
    std::vector<LossSums> sums;
    StepStats st;
    if (engine_) {
        // The device runs the whole step (the optimizer included; a graph replay with
        // cuda_graph_impl full_iteration).
        // Its NCCL collectives run on the device: the host's wait for the step is what the
        // collective deadline watches.
        CollectiveWatchdog::Scope watched("the device step");
        DeviceEngine::StepOutcome o =
            engine_->run_step(mine, sc, recipe_.run, m.step, dynamic ? &cps : nullptr);
        sums = std::move(o.losses);
        st = o.stats;
        m.graph = o.replayed;
        m.moe_stash_pages = o.stash.pool_pages;
        m.moe_stash_peak_pages = o.stash.peak_pages;
        if (o.redone) {
            m.moe_stash_redo = true;
            // The first redo of the run says why; later ones are counted in the metrics.
            if (stash_redos_++ == 0 && world_rank() == 0)
                std::cerr << "warning: " << stash_overflow_message(mc, o.stash, m.step) << "\n";
        }
        m.moe_stash_redos = stash_redos_;
    } else {
        zero_grads(tp_->plan);
        tp_->model->reset_moe_stats();
        if (pipeline_) {
            sums = pipeline_->run(mine, dynamic ? &cps : nullptr, sc);
        } else {
            for (size_t i = 0; i < mine.size(); ++i) {
                if (dynamic) tp_->model->set_context_parallel(cps[i]);
                tp_->model->load_inputs(*mine[i]);
                sums.push_back(tp_->model->forward_backward(sc));
            }
        }
    }
    double loss_sum = 0, mtp = 0, accept = 0;
    for (const LossSums& s : sums) {
        loss_sum += s.lm_loss_sum;
        for (size_t k = 0; k < s.mtp_sum.size(); ++k) mtp += s.mtp_sum[k] * sc.mtp[k];
        accept += s.mtp_acceptance_sum;
        m.indexer_loss += s.indexer_loss * sc.indexer;
        m.aux_loss += s.aux_loss;
    }
    if (world_size() > 1) {
        // Sum loss sums, gradients and routing statistics over every rank: data-parallel ranks
        // ran other micro-batches, CP ranks other rows of the same ones, pipeline stages other
        // layers (the CUDA engine summed gradients and statistics on the device inside its step).
        Comm& comm = *options_.comm;
        double sums[5] = {loss_sum, mtp, accept, m.indexer_loss, m.aux_loss};
        comm.allreduce_sum(sums, 5);
        loss_sum = sums[0], mtp = sums[1], accept = sums[2], m.indexer_loss = sums[3];
        m.aux_loss = sums[4];
    }
    if (world_size() > 1 && !engine_) {
        // Dense gradients over the stage's ranks (every rank without pipeline parallelism); the
        // sharded experts' over the ranks holding the same experts (none to reduce when every
        // rank holds other experts).
        Comm* stage = stage_comm();
        Comm* edp =
            groups_ && recipe_.run.expert_model_parallel_size > 1 ? groups_->edp.get() : stage;
        for (const GradRange& g : grad_ranges_) {
            Comm* over = g.routed_expert ? edp : stage;
            if (over->size() > 1) over->allreduce_sum(g.begin, g.count);
        }
        reduce_shared_embedding();
        reduce_moe_stats(m);
    }
    m.lm_loss = loss_sum / double(m.targets);
    m.mtp_loss = mtp;
    if (tv && D > 0 && mtp_rows[0] > 0) m.mtp_acceptance_length = accept / double(mtp_rows[0]);
    m.total_loss = m.lm_loss + m.mtp_loss + m.indexer_loss + m.aux_loss;
    if (engine_) {
        m.moe_load = engine_->moe_loads();
        m.moe_dropped = engine_->moe_dropped();
        if (groups_ && groups_->pp) gather_stage_moe_metrics(m);
        if (!st.skipped) engine_->update_router_bias(mc.moe_router_bias_update_rate);
    } else {
        if (!pipeline_) {
            m.moe_load = tp_->model->moe_loads();
            m.moe_dropped = tp_->model->moe_dropped();
        }
        const bool shard = !owner_.empty();
        st = tp_->optimizer->step(tp_->plan, recipe_.run, m.step, warmup ? &indexer_only_ : nullptr,
                                  shard ? &owned_ : nullptr);
        // Distributed optimizer: every parameter from the rank that updated it (the skip
        // decision and the clipping factor are the same on every rank: the gradients are).
        if (shard && !st.skipped) broadcast_from_owners(/*state=*/false);
        if (!st.skipped && !warmup) tp_->model->update_router_bias(mc.moe_router_bias_update_rate);
    }
    m.lr = st.lr;
    m.grad_norm = st.grad_norm;
    m.grad_norm_mtp = st.grad_norm_mtp;
    m.skipped = st.skipped;
    state_.iteration = m.step;
    state_.consumed_tokens += m.tokens;
    if (st.skipped) ++state_.skipped_steps;
    m.step_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return m;
}

namespace {

// The step's samples for dynamic CP: every document (piece) of the packed micro-batches.
struct StepSample {
    const MicroBatch* mb;
    int64_t begin, length;
};

std::vector<StepSample> step_samples(const std::vector<MicroBatch>& batches) {
    std::vector<StepSample> out;
    for (const MicroBatch& mb : batches)
        for (int64_t d = 0; d < mb.num_documents; ++d)
            out.push_back({&mb, mb.cu_seqlens[d], mb.cu_seqlens[d + 1] - mb.cu_seqlens[d]});
    return out;
}

}  // namespace

std::vector<const MicroBatch*> Trainer::dynamic_cp_batches(std::vector<Comm*>& cps,
                                                           StepMetrics& m) {
    // Every rank computes the same schedule; a rank runs the groups that hold it, with CP = the
    // group's size over the aligned sub-communicator of that size (made once; none for a group
    // of one rank). With expert parallelism every micro-batch's MoE layers exchange rows over
    // the EP group, whose ranks may sit in different CP groups: a rank the schedule leaves idle
    // in a micro-batch runs an empty one (no documents: nothing routed, no loss) so that it
    // joins the same exchanges in the same order as its EP peers.
    const bool join_exchanges = recipe_.run.expert_model_parallel_size > 1;
    const std::vector<StepSample> samples = step_samples(batches_);
    std::vector<int64_t> lengths;
    for (const StepSample& s : samples) lengths.push_back(s.length);
    const int me = stage_rank();
    std::vector<const MicroBatch*> out;
    cps.clear();
    const auto next_batch = [&]() -> MicroBatch& {
        if (out.size() == group_batches_.size())
            group_batches_.push_back(
                std::make_unique<MicroBatch>(tp_->group_slots, tp_->group_max_documents));
        MicroBatch& mb = *group_batches_[out.size()];
        mb.clear();
        return mb;
    };
    for (const auto& smb :
         schedule_dynamic_cp(lengths, stage_size(), recipe_.run.max_seqlen_per_dp_cp_rank)) {
        m.dynamic_cp_idle_ranks += smb.idle_ranks;
        const size_t before = out.size();
        for (const DynamicCpGroup& g : smb.groups) {
            int bucket = 0;
            while ((1 << bucket) < g.size) ++bucket;
            if (int(m.dynamic_cp_groups.size()) <= bucket) m.dynamic_cp_groups.resize(bucket + 1);
            ++m.dynamic_cp_groups[size_t(bucket)];
            if (me < g.first_rank || me >= g.first_rank + g.size) continue;
            ST_ASSERT(g.first_rank % g.size == 0, "dynamic CP group not aligned");
            MicroBatch& mb = next_batch();
            for (int s : g.samples) {
                const StepSample& x = samples[size_t(s)];
                std::vector<int32_t> doc(x.mb->tokens.begin() + x.begin,
                                         x.mb->tokens.begin() + x.begin + x.length);
                ST_CHECK(mb.add_document(doc), "dynamic CP: a group's micro-batch holds more than ",
                         mb.max_documents, " documents (raise max_documents_per_microbatch)");
            }
            cps.push_back(g.size > 1 ? &groups_->dynamic(g.size) : nullptr);
            out.push_back(&mb);
        }
        if (join_exchanges && out.size() == before) {
            out.push_back(&next_batch());
            cps.push_back(nullptr);
        }
    }
    return out;
}

void Trainer::reduce_moe_stats(StepMetrics& m) {
    std::vector<int64_t> mine = tp_->model->moe_stats_flat();
    if (!pipeline_) {
        std::vector<double> st(mine.begin(), mine.end());
        options_.comm->allreduce_sum(st.data(), int64_t(st.size()));
        for (size_t k = 0; k < st.size(); ++k) mine[k] = int64_t(st[k]);
        tp_->model->set_moe_stats_flat(mine);
        return;
    }
    // Stages hold other MoE layers: the whole model's statistics are the stages' flat vectors
    // one after another (the MTP layer's come last). One sum over every rank adds each stage's
    // data-parallel replicas and fills in the other stages.
    size_t offset = 0;
    const std::vector<double> all = stages_concatenated(
        *groups_->pp, *options_.comm, std::vector<double>(mine.begin(), mine.end()), &offset);
    const size_t total = all.size();
    for (size_t k = 0; k < mine.size(); ++k) mine[k] = int64_t(all[offset + k]);
    tp_->model->set_moe_stats_flat(mine);
    // The metrics: the backbone's MoE layers' loads (E each, then the dropped count), and the
    // dropped rows of every MoE application, MTP included.
    const ModelConfig& mc = recipe_.model;
    const int64_t E = mc.num_experts;
    int64_t backbone = 0;
    for (int64_t l = 0; l < mc.num_layers; ++l) backbone += mc.moe_layer_pattern[size_t(l)] ? 1 : 0;
    m.moe_load.clear();
    m.moe_dropped = 0;
    for (size_t at = 0, layer = 0; at < total; at += size_t(E) + 1, ++layer) {
        if (int64_t(layer) < backbone)
            m.moe_load.emplace_back(all.begin() + std::ptrdiff_t(at),
                                    all.begin() + std::ptrdiff_t(at + size_t(E)));
        m.moe_dropped += int64_t(all[at + size_t(E)]);
    }
}

void Trainer::gather_stage_moe_metrics(StepMetrics& m) {
    // The engine summed each stage's statistics over the stage's ranks: the pipeline group (one
    // rank per stage) puts the stages' MoE layers one after another, in layer order.
    Comm& pp = *groups_->pp;
    std::vector<double> mine;
    for (const auto& layer : m.moe_load) mine.insert(mine.end(), layer.begin(), layer.end());
    const std::vector<double> all = stages_concatenated(pp, pp, mine);
    const size_t E = size_t(recipe_.model.num_experts);
    m.moe_load.clear();
    for (size_t at = 0; E > 0 && at + E <= all.size(); at += E)
        m.moe_load.emplace_back(all.begin() + std::ptrdiff_t(at),
                                all.begin() + std::ptrdiff_t(at + E));
    double dropped = double(m.moe_dropped);
    pp.allreduce_sum(&dropped, 1);
    m.moe_dropped = int64_t(dropped);
}

void Trainer::reduce_shared_embedding() {
    if (!groups_ || !groups_->embedding || groups_->embedding->size() < 2) return;
    if (recipe_.model.mtp_num_layers == 0) return;  // the last stage holds no copy
    const ParamStore& store = tp_->model->params();
    const int64_t i = store.index_of("model.embed_tokens.weight");
    ST_ASSERT(i >= 0, "pipeline: the embedding is not on this stage");
    const ParamInfo& p = store.params()[size_t(i)];
    groups_->embedding->allreduce_sum(tp_->plan.view(p.grad_slot).ptr<float>(), p.numel());
}

void Trainer::assign_owners() {
    // Muon's Newton-Schulz costs ~ numel x min(rows, cols), AdamW ~ numel.
    const auto& params = tp_->model->params().params();
    const bool muon = recipe_.run.optimizer == "muon";
    std::vector<double> cost(params.size(), -1.0);
    for (size_t i = 0; i < params.size(); ++i) {
        if (!params[i].trainable) continue;
        cost[i] = double(params[i].numel());
        if (muon && params[i].group == OptimGroup::Muon && params[i].shape.size() == 2)
            cost[i] *= double(std::min(params[i].shape[0], params[i].shape[1]));
    }
    // Sharded experts: each rank updates its own (the ranks of its EDP group hold the same
    // reduced gradients and update them alike); the rest goes to owners.
    const bool sharded = recipe_.run.expert_model_parallel_size > 1;
    for (size_t i = 0; i < params.size(); ++i)
        if (sharded && params[i].routed_expert) cost[i] = -1.0;
    // Owners are ranks of this stage (the ranks holding the same parameters).
    owner_ = assign_owners_greedy(cost, stage_size());
    owned_.assign(params.size(), false);
    for (size_t i = 0; i < params.size(); ++i) {
        if (sharded && params[i].routed_expert && params[i].trainable) owner_[i] = kLocalOwner;
        owned_[i] = owner_[i] == stage_rank() || owner_[i] == kLocalOwner;
    }
}

void Trainer::broadcast_from_owners(bool state) {
    Comm& comm = *stage_comm();
    const auto& params = tp_->model->params().params();
    if (!state) {
        for (size_t i = 0; i < params.size(); ++i)
            if (owner_[i] >= 0)
                comm.broadcast(tp_->plan.view(params[i].param_slot).data,
                               int64_t(params[i].numel() * sizeof(float)), owner_[i]);
        return;
    }
    // Optimizer state tensors are named "<parameter>.<state>".
    std::map<std::string, int> owner_of;
    for (size_t i = 0; i < params.size(); ++i) owner_of[params[i].name] = owner_[i];
    for (const auto& [name, slot] : tp_->optimizer->state_tensors()) {
        const auto it = owner_of.find(name.substr(0, name.rfind('.')));
        ST_ASSERT(it != owner_of.end(), "state tensor ", name, " has no parameter");
        // Owner -1: state every rank keeps whole (the CUDA Muon momentum).
        if (it->second < 0) continue;
        comm.broadcast(tp_->plan.view(slot).data, int64_t(tp_->plan.entries()[slot].bytes),
                       it->second);
    }
}

std::string Trainer::save() {
    // Every rank's device state to its host mirror, then a distributed optimizer's state is
    // gathered from its owners: every rank holds the full state after (of its own experts, when
    // they are sharded); rank 0 writes, or with sharded experts one rank per EP rank.
    if (engine_) engine_->download_state();
    if (!owner_.empty()) broadcast_from_owners(/*state=*/true);
    state_.data_position = stream_->position().to_json();
    if (groups_ && (recipe_.run.expert_model_parallel_size > 1 || groups_->pp)) {
        // Sharded experts or stages: the first EP group's ranks of each stage write a shard each
        // (its first rank's with the stage's dense tensors), the replicas nothing.
        const ParallelLayout& l = groups_->layout;
        const int me = world_rank();
        CheckpointShards shards{options_.comm,
                                l.edp_rank(me) == 0 ? l.pp_rank(me) * l.ep + l.ep_rank(me) : -1,
                                l.pp * l.ep, l.ep_rank(me) == 0};
        return save_checkpoint(checkpoint_dir(), {recipe_.run.save_keep_last, &saved_},
                               recipe_.model, recipe_.to_yaml(), tp_->model->params(), tp_->plan,
                               tp_->optimizer.get(), state_, &shards);
    }
    if (world_rank() != 0) return checkpoint_dir();
    return save_checkpoint(checkpoint_dir(), {recipe_.run.save_keep_last, &saved_}, recipe_.model,
                           recipe_.to_yaml(), tp_->model->params(), tp_->plan, tp_->optimizer.get(),
                           state_);
}

std::optional<StepMetrics::Valid> Trainer::validate() {
    if (!valid_stream_) return std::nullopt;
    const RunConfig& r = recipe_.run;
    const ModelConfig& mc = recipe_.model;
    valid_stream_->set_position(
        StreamPosition{std::vector<int64_t>(size_t(valid_stream_->num_datasets()), 0),
                       std::vector<int64_t>(size_t(valid_stream_->num_datasets()), 0),
                       std::vector<int64_t>(size_t(valid_stream_->num_datasets()), 0)});
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
        std::vector<LossSums> got;
        if (pipeline_) {
            got = pipeline_->run(mine, nullptr, sc);
        } else {
            if (engine_) {
                got = engine_->forward_only(mine, sc);
            } else {
                for (const MicroBatch* mb : mine) {
                    tp_->model->load_inputs(*mb);
                    got.push_back(tp_->model->forward_backward(sc));
                }
            }
        }
        for (const LossSums& s : got) {
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
        ST_CHECK(r.skipped_iters_limit == 0 || skipped_in_a_row < r.skipped_iters_limit,
                 skipped_in_a_row, " consecutive steps (", m.step - skipped_in_a_row + 1, "..",
                 m.step,
                 ") were skipped for non-finite gradients: the run diverged and stops "
                 "(skipped_iters_limit ",
                 r.skipped_iters_limit,
                 "); resume from an earlier checkpoint with a lower lr, or check the data");
        const bool last = state_.iteration == r.train_iters;
        const bool scheduled =
            (r.save_interval > 0 && state_.iteration % r.save_interval == 0) || last;
        End end = stop_after_this_step(start);
        if (options_.save_checkpoints && (scheduled || end.kind != End::Finished)) save();
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
