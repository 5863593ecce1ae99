// Checked errors with clear messages (DESIGN §1.5).
//
// User-facing failures (bad config, data, checkpoint, launch) throw `sparsetron::Error` whose
// message names the file/key and what was expected. `ST_CHECK` is for those; `ST_ASSERT` is for
// internal invariants (a failure there is a bug in Sparsetron, and the message says so).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace sparsetron {

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Concatenates its arguments with operator<< (a tiny, dependency-free formatter).
template <typename... Args>
std::string cat(const Args&... args) {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
}

// What a CUDA entry point does in a build without CUDA (the `*_no_cuda.cpp` stubs, each beside
// what it stubs): it names itself and how to get a CUDA build.
[[noreturn]] inline void built_without_cuda(const char* what) {
    throw Error(cat(what, ": Sparsetron was built without CUDA (rebuild with nvcc on PATH)"));
}

}  // namespace sparsetron

#define ST_CHECK(cond, ...)                                                     \
    do {                                                                        \
        if (!(cond)) throw ::sparsetron::Error(::sparsetron::cat(__VA_ARGS__)); \
    } while (0)

#define ST_ASSERT(cond, ...)                                                                      \
    do {                                                                                          \
        if (!(cond))                                                                              \
            throw ::sparsetron::Error(::sparsetron::cat(                                          \
                "internal error at ", __FILE__, ":", __LINE__, ": ", #cond, " ", ##__VA_ARGS__)); \
    } while (0)
