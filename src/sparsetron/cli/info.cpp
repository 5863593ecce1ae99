// `sparsetron info`: the build, the device, and the environment variables the engine reads.
#include <cstdio>

#include "command.h"
#include "sparsetron/core/device_memory.h"
#include "sparsetron/core/env.h"
#include "sparsetron/core/thread_pool.h"

namespace sparsetron::cli {

Run add_info(CLI::App& app) {
    app.add_subcommand("info", "Build and device information, and the environment variables read");
    return [] {
        std::printf("sparsetron %s\ncuda backend: %s\ngpu: %s\ncpu threads: %d\n",
                    SPARSETRON_VERSION,
#ifdef SPARSETRON_WITH_CUDA
                    "built",
#else
                    "not built",
#endif
                    cuda_available() ? cuda_device_name().c_str() : "none", num_threads());
        std::printf("\nenvironment variables (all the engine reads; docs/architecture.md):\n");
        for (const EnvVar& v : env_vars()) {
            const auto value = env_value(v.name);
            std::printf("  %-27s %-14s %s\n", v.name, value ? value->c_str() : "(unset)",
                        v.meaning);
        }
        return 0;
    };
}

}  // namespace sparsetron::cli
