#include "sparsetron/parallel/comm.h"

#include <cstdlib>

#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"

namespace sparsetron {

void SingleProcessComm::abort(int code) {
    std::exit(code);
}

void check_same_on_all_ranks(Comm& comm, const std::string& text, const std::string& what) {
    const std::vector<uint64_t> hashes = comm.allgather(hash_name(text.c_str()));
    for (size_t r = 1; r < hashes.size(); ++r)
        ST_CHECK(hashes[r] == hashes[0], "rank ", r, " loaded a different ", what, " than rank 0 (",
                 "hash ", hashes[r], " vs ", hashes[0], "); every rank must run the same ", what);
}

}  // namespace sparsetron
