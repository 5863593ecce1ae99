// `sparsetron convert`: model weights between the engine's checkpoints and HuggingFace
// directories. To HF: bf16 (or fp32) shards of about `shard_bytes` each
// (model-0000i-of-0000N.safetensors with model.safetensors.index.json), config.json and
// generation_config.json: what transformers' from_pretrained and the Hub expect. To the engine:
// one fp32 model.safetensors with config.json, which `train --load` and `eval` read. Either way
// FP8 e4m3 sources (with their 128x128 `_scale_inv` blocks) are dequantized, and the MTP layer's
// tensors travel along (transformers reports them as unused).
#pragma once

#include <cstdint>
#include <string>

#include "sparsetron/core/dtype.h"

namespace sparsetron {

struct ConvertOptions {
    std::string input;   // a checkpoint, a save directory (its latest), or an HF directory
    std::string output;  // created; must not hold weights already
    bool to_hf = true;
    DType dtype = DType::BF16;               // of the written tensors (BF16 or F32)
    int64_t shard_bytes = int64_t(5) << 30;  // to_hf: the largest shard before the next starts
};

struct ConvertResult {
    int64_t tensors = 0, shards = 0, bytes = 0;
};

ConvertResult convert_checkpoint(const ConvertOptions& o);

}  // namespace sparsetron
