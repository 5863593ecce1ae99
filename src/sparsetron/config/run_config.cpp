#include "sparsetron/config/run_config.h"

namespace sparsetron {

int64_t RunConfig::data_parallel_size() const {
    int64_t model_parallel =
        tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size;
    return model_parallel > 0 ? world_size / model_parallel : 0;
}

int64_t RunConfig::microbatches_per_step() const {
    int64_t per_step = micro_batch_size * data_parallel_size();
    return per_step > 0 ? global_batch_size / per_step : 0;
}

}  // namespace sparsetron
