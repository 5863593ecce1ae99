// `sparsetron convert`: model weights between engine checkpoints and HuggingFace directories.
#include <cmath>
#include <cstdio>
#include <memory>

#include "command.h"
#include "sparsetron/io/convert.h"

namespace sparsetron::cli {

Run add_convert(CLI::App& app) {
    struct Options {
        std::string input, output, to = "hf", dtype = "bf16";
        double shard_gib = 5;
    };
    auto o = std::make_shared<Options>();
    auto* c = app.add_subcommand(
        "convert",
        "Convert model weights: engine checkpoint -> HF directory (bf16 shards) or back");
    c->add_option("--input,-i", o->input,
                  "A checkpoint, a save directory (its latest checkpoint) or an HF directory")
        ->required();
    c->add_option("--output,-o", o->output, "The directory to write (must hold no weights)")
        ->required();
    c->add_option("--to", o->to,
                  "hf (default: shards, index, config.json, generation_config.json) or engine "
                  "(one fp32 model.safetensors that train --load and eval read)");
    c->add_option("--dtype", o->dtype, "With --to hf: bf16 (default) or fp32");
    c->add_option("--shard-size-gib", o->shard_gib, "With --to hf: the largest shard (default 5)");
    return [o] {
        ST_CHECK(o->to == "hf" || o->to == "engine", "convert: --to is hf or engine, got '", o->to,
                 "'");
        ST_CHECK(o->dtype == "bf16" || o->dtype == "fp32", "convert: --dtype is bf16 or fp32");
        // An infinite or absurd size converted to bytes overflows (one tensor per shard).
        ST_CHECK(std::isfinite(o->shard_gib) && o->shard_gib > 0 && o->shard_gib <= 1 << 20,
                 "convert: --shard-size-gib must be a size in (0, 1048576] GiB, got ",
                 o->shard_gib);
        ConvertOptions opts;
        opts.input = o->input;
        opts.output = o->output;
        opts.to_hf = o->to == "hf";
        opts.dtype = o->dtype == "fp32" ? DType::F32 : DType::BF16;
        opts.shard_bytes = std::max<int64_t>(1, int64_t(o->shard_gib * double(1ull << 30)));
        const ConvertResult r = convert_checkpoint(opts);
        std::printf("converted %lld tensors (%.3f GiB) into %lld file%s -> %s\n",
                    static_cast<long long>(r.tensors), double(r.bytes) / double(1ull << 30),
                    static_cast<long long>(r.shards), r.shards == 1 ? "" : "s", o->output.c_str());
        return 0;
    };
}

}  // namespace sparsetron::cli
