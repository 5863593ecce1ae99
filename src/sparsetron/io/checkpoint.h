// Checkpoints (DESIGN §1.5): one directory per saved iteration, `iter_NNNNNNN/`, holding
//   config.json          HF glm_moe_dsa config of the model
//   model.safetensors    weights by HF names (fp32 master copy)
//   optimizer.safetensors  AdamW state as <name>.exp_avg / <name>.exp_avg_sq (Muon's as
//                        <name>.momentum_buffer)
// or, with experts sharded over EP ranks, shards of both with index files (CheckpointShards),
//   trainer_state.json   iteration, consumed tokens, data position, RNG seed, the run's id and
//                        every other file's digest (io/checkpoint_identity.h)
//   recipe.yaml          the effective recipe
// written under a temporary name, synced to disk and renamed, so a crash never leaves a
// half-written checkpoint; `latest_checkpointed_iteration.txt` (Megatron's name) is then replaced
// the same way, and the run's own older checkpoints beyond its `keep_last` are deleted (Retention).
// Loading verifies what the save recorded: each tensor's CRC-32C, each file's digest, finite
// values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/io/safetensors.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/optim/optimizer.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

struct TrainerState {
    int64_t iteration = 0;
    int64_t consumed_tokens = 0;
    int64_t skipped_steps = 0;
    uint64_t seed = 0;
    std::string data_position;  // StreamPosition JSON
    std::string run_id;         // the run's id (new_run_id), the same across its resumes
};

// Fails early, naming `dir`, if it cannot be created or written.
void ensure_writable_dir(const std::string& dir);

// A checkpoint written by several ranks (expert parallelism: each EP rank holds other experts;
// pipeline parallelism: each stage other layers). Every rank of `world` calls save_checkpoint;
// the ranks with shard >= 0 (one per EP rank of each stage) write model-<s>-of-<n>.safetensors
// and optimizer-<s>-of-<n>.safetensors (with `dense` also the dense tensors they hold, pipeline
// copies excepted; the others their routed experts only), rank 0 the index files
// (model.safetensors.index.json, HF's sharded format; optimizer.safetensors.index.json) and
// the rest. The ranks must share the file system (one host, or a shared save directory).
struct CheckpointShards {
    Comm* world = nullptr;
    int shard = -1;  // -1: this rank writes no shard (another rank holds the same tensors)
    int shards = 1;
    bool dense = true;
};

// Which checkpoints a save may delete: those of its run (`run_id`, kept across resumes, so a
// resumed run bounds what its earlier parts saved too) up to the iteration just saved, beyond the
// newest `keep_last` of them. Another run's checkpoints in the same directory, those without a
// run id (saved before ids were recorded) and those of later iterations (a run resumed from an
// earlier checkpoint) are never deleted. keep_last 0 or no run_id: none.
struct Retention {
    int64_t keep_last = 0;
    std::string run_id;
};

std::string save_checkpoint(const std::string& save_dir, const Retention& retention,
                            const ModelConfig& m, const std::string& recipe_yaml,
                            const ParamStore& store, const MemoryPlan& plan,
                            const Optimizer* optimizer, const TrainerState& state,
                            const CheckpointShards* shards = nullptr);

// `dir` is a checkpoint directory or a save directory with latest_checkpointed_iteration.txt.
std::string resolve_checkpoint(const std::string& dir);
// A directory with config.json and weights (single model.safetensors or a sharded index).
bool is_model_dir(const std::string& dir);
// Where each tensor of a weights directory lives (name -> file path): every tensor of
// <base>.safetensors, or the shards <base>.safetensors.index.json names.
std::map<std::string, std::string> tensor_files(const std::string& dir,
                                                const std::string& base = "model");
// One tensor of a weights file as fp32: F32, F64, BF16, or F8_E4M3 times its `<name>_scale_inv`
// 128x128 block scales (F32 or BF16, in the same file).
std::vector<float> read_tensor_f32(const SafetensorsFile& file, const std::string& name);
// read_tensor_f32 with what a load checks: the tensor's CRC-32C (where the file records one) and
// finite values (and >= 0 for a second-moment estimate); throws naming the file and the tensor.
std::vector<float> read_checked_tensor_f32(const SafetensorsFile& file, const std::string& name);
// Weights of a pretrained model (an HF directory or an engine checkpoint) for a run that starts
// at iteration 0 with fresh optimizer state: every parameter the files hold is loaded (FP8 e4m3
// weights with 128x128 `<name>_scale_inv` blocks, the DeepSeek-V3 / GLM release format, are
// dequantized); the MTP layer's parameters keep their initialization when the files have none
// (HF's glm_moe_dsa has no MTP module). Any other missing parameter is an error naming it.
// Returns the parameters left at their initialization.
std::vector<std::string> load_pretrained_weights(const std::string& dir, const ParamStore& store,
                                                 const MemoryPlan& plan);
// Copies weights into the planned parameters; every parameter must be present with its shape.
// Reads model.safetensors, or the shards listed in model.safetensors.index.json; tensors the
// store does not hold (another EP rank's experts) are not read.
void load_model_weights(const std::string& ckpt_dir, const ParamStore& store,
                        const MemoryPlan& plan);
void load_optimizer_state(const std::string& ckpt_dir, const ParamStore& store,
                          const Optimizer& optimizer, const MemoryPlan& plan);
TrainerState load_trainer_state(const std::string& ckpt_dir);
std::string load_checkpoint_recipe(const std::string& ckpt_dir);  // recipe.yaml text

}  // namespace sparsetron
