// A training step's scalars into TensorBoard (tensorboard_dir), with Megatron's tag names where
// it has them ("lm loss", "learning-rate", "grad-norm", "lm loss validation").
#pragma once

#include "sparsetron/io/tensorboard.h"
#include "sparsetron/runtime/trainer.h"

namespace sparsetron {

// Losses, learning rate, gradient norms, step time and tokens/s, `memory_gib`, per-expert loads
// (tokens routed to each expert of each MoE application), and the validation losses when the
// step ran a validation.
void write_step_scalars(TensorBoardWriter& tb, const StepMetrics& m, double memory_gib);

}  // namespace sparsetron
