// Moving key rows between a context-parallel rank's rows and the whole micro-batch (SPEC §10).
//
// Under CP a rank computes its own rows' latent keys K' and indexer keys k_I, but its queries
// attend over keys of every earlier row of their document. cp_gather_rows assembles the
// micro-batch's keys on every rank; cp_reduce_rows sends the key gradients (every rank's queries
// contribute to every key) back to the rows that own them. Both are one all-reduce over the CP
// group of a zero-filled micro-batch buffer: in the gather every row has exactly one nonzero
// contributor, so the sum is exact. Called only by a model planned for CP; with in.cp null (a
// group of one rank under dynamic CP) the rank holds every row and only the reordering remains.
#pragma once

#include <algorithm>

#include "sparsetron/model/step_inputs.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

// full [key_rows(in), dim] <- every CP rank's `local` [in.tokens, dim] at its rows' key rows.
template <typename T>
void cp_gather_rows(const StepInputs& in, const T* local, int64_t dim, T* full) {
    std::fill_n(full, key_rows(in) * dim, T(0));
    for (int64_t i = 0; i < in.tokens; ++i) {
        const int64_t r = key_row(in, i);
        if (r >= 0) std::copy_n(local + i * dim, dim, full + r * dim);
    }
    if (in.cp) in.cp->allreduce_sum(full, key_rows(in) * dim);
}

// full [key_rows(in), dim] (this rank's contributions; summed in place over the CP group), then
// local [in.tokens, dim] <- the sums at this rank's rows (0 for padding rows).
template <typename T>
void cp_reduce_rows(const StepInputs& in, T* full, int64_t dim, T* local) {
    if (in.cp) in.cp->allreduce_sum(full, key_rows(in) * dim);
    for (int64_t i = 0; i < in.tokens; ++i) {
        const int64_t r = key_row(in, i);
        if (r >= 0)
            std::copy_n(full + r * dim, dim, local + i * dim);
        else
            std::fill_n(local + i * dim, dim, T(0));
    }
}

}  // namespace sparsetron
