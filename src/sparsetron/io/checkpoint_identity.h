// Checkpoint identity: a checkpoint's files belong together. Every run has a random id, kept
// across its resumes; each safetensors file of a checkpoint records the run and the iteration in
// its metadata, and trainer_state.json records a digest of every other file of the directory, so
// a file copied in from another iteration or another run (or changed after the save) is refused
// by whatever reads the checkpoint: train --resume, eval, convert.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace sparsetron {

// 16 hex digits from the system's random source.
std::string new_run_id();

// The safetensors metadata that ties a file to its checkpoint.
std::map<std::string, std::string> checkpoint_file_metadata(const std::string& run_id,
                                                            int64_t iteration);

// file name -> digest, for every regular file of `dir` but trainer_state.json (and temporaries):
// a safetensors file by the CRC-32C of its header (which holds every tensor's CRC-32C), any other
// file by the CRC-32C of its bytes.
std::map<std::string, std::string> checkpoint_file_digests(const std::string& dir);

// Throws, naming the file and what it belongs to, when a file trainer_state.json records is
// missing or differs from its digest. Directories without trainer_state.json (HF weights) and
// checkpoints saved before digests were recorded pass unchecked.
void verify_checkpoint_files(const std::string& ckpt_dir);

}  // namespace sparsetron
