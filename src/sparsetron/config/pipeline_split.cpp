#include "sparsetron/config/pipeline_split.h"

#include "sparsetron/config/pipeline_layout.h"
#include "sparsetron/core/error.h"

namespace sparsetron {

std::vector<int64_t> pipeline_layer_counts(int64_t num_layers, int64_t stages, int64_t first,
                                           int64_t last) {
    ST_CHECK(stages >= 1, "pipeline_model_parallel_size must be >= 1");
    if (stages == 1) return {num_layers};
    ST_CHECK(first >= 0 && last >= 0,
             "decoder_first/last_pipeline_num_layers must be >= 0 (0: an even share)");
    const int64_t fixed = int64_t(first > 0) + int64_t(last > 0);
    const int64_t middle_stages = stages - fixed;
    const int64_t rest = num_layers - first - last;
    ST_CHECK(rest >= 0, "decoder_first_pipeline_num_layers (", first,
             ") + decoder_last_pipeline_num_layers (", last, ") exceed num_layers (", num_layers,
             ")");
    const bool splits =
        middle_stages > 0 ? rest % middle_stages == 0 && rest / middle_stages > 0 : rest == 0;
    ST_CHECK(splits || fixed > 0, "num_layers ", num_layers, " does not divide evenly over ",
             stages,
             " pipeline stages (pipeline_model_parallel_size); set "
             "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers to split it "
             "unevenly");
    ST_CHECK(splits, "num_layers ", num_layers, " does not split over ", stages,
             " pipeline stages: with decoder_first_pipeline_num_layers ", first,
             " and decoder_last_pipeline_num_layers ", last, " the remaining ", rest,
             " layers must divide evenly (at least one each) over the remaining ", middle_stages,
             " stages");
    std::vector<int64_t> counts(size_t(stages), middle_stages > 0 ? rest / middle_stages : 0);
    if (first > 0) counts.front() = first;
    if (last > 0) counts.back() = last;
    return counts;
}

int64_t pipeline_virtual_stages(const ModelConfig& m, const RunConfig& r) {
    const int64_t P = r.pipeline_model_parallel_size;
    const int64_t by_count = r.num_virtual_stages_per_pipeline_rank,
                  by_layers = r.num_layers_per_virtual_pipeline_stage;
    ST_CHECK(by_count == 0 || by_layers == 0,
             "num_virtual_stages_per_pipeline_rank and num_layers_per_virtual_pipeline_stage both "
             "set the interleaving: set one");
    int64_t v = 1;
    if (by_count > 0) v = by_count;
    if (by_layers > 0) {
        ST_CHECK(m.num_layers % (P * by_layers) == 0, "num_layers_per_virtual_pipeline_stage ",
                 by_layers, ": num_layers ", m.num_layers, " must be a multiple of it times ",
                 "pipeline_model_parallel_size ", P);
        v = m.num_layers / (P * by_layers);
    }
    if (!r.pipeline_model_parallel_layout.empty()) {
        const int64_t n = int64_t(parse_pipeline_layout(r.pipeline_model_parallel_layout).size());
        ST_CHECK(n % P == 0, "pipeline_model_parallel_layout \"", r.pipeline_model_parallel_layout,
                 "\": ", n, " stages over pipeline_model_parallel_size ", P,
                 ": a multiple of it (one stage per rank, or interleaved virtual stages)");
        ST_CHECK(by_count == 0 && by_layers == 0 ? true : n / P == v,
                 "pipeline_model_parallel_layout has ", n / P,
                 " stages per pipeline rank, the virtual-stage key says ", v);
        v = n / P;
    }
    ST_CHECK(v == 1 || P > 1,
             "interleaved virtual pipeline stages need pipeline_model_parallel_size > 1");
    ST_CHECK(v == 1 || (r.decoder_first_pipeline_num_layers == 0 &&
                        r.decoder_last_pipeline_num_layers == 0),
             "decoder_first/last_pipeline_num_layers with interleaved virtual stages: give the "
             "split as pipeline_model_parallel_layout instead");
    return v;
}

std::vector<int64_t> pipeline_stage_layers(const ModelConfig& m, const RunConfig& r) {
    const int64_t stages = r.pipeline_model_parallel_size * pipeline_virtual_stages(m, r);
    if (r.pipeline_model_parallel_layout.empty())
        return pipeline_layer_counts(m.num_layers, stages, r.decoder_first_pipeline_num_layers,
                                     r.decoder_last_pipeline_num_layers);
    ST_CHECK(r.decoder_first_pipeline_num_layers == 0 && r.decoder_last_pipeline_num_layers == 0,
             "pipeline_model_parallel_layout and decoder_first/last_pipeline_num_layers both "
             "split the layers: set one");
    return pipeline_layout_counts(r.pipeline_model_parallel_layout, m.num_layers, m.mtp_num_layers,
                                  stages);
}

PipelineStage pipeline_stage(const ModelConfig& m, const RunConfig& r, int index) {
    const std::vector<int64_t> counts = pipeline_stage_layers(m, r);
    ST_CHECK(index >= 0 && index < int(counts.size()), "pipeline stage ", index, " of ",
             counts.size());
    PipelineStage s;
    s.index = index;
    s.count = int(counts.size());
    for (int i = 0; i < index; ++i) s.first_layer += counts[size_t(i)];
    s.end_layer = s.first_layer + counts[size_t(index)];
    return s;
}

std::vector<PipelineStage> pipeline_rank_stages(const ModelConfig& m, const RunConfig& r,
                                                int pp_rank) {
    const int64_t P = r.pipeline_model_parallel_size, V = pipeline_virtual_stages(m, r);
    std::vector<PipelineStage> out;
    for (int64_t v = 0; v < V; ++v) out.push_back(pipeline_stage(m, r, int(v * P + pp_rank)));
    return out;
}

}  // namespace sparsetron
