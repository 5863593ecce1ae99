#include "sparsetron/runtime/evaluate.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "sparsetron/config/hf_config.h"
#include "sparsetron/core/error.h"
#include "sparsetron/io/checkpoint.h"
#include "sparsetron/model/glm5_model.h"

namespace fs = std::filesystem;

namespace sparsetron {

std::vector<std::vector<int32_t>> read_token_documents(const std::string& path) {
    std::ifstream in(path);
    ST_CHECK(in.good(), "cannot read token file '", path, "'");
    std::vector<std::vector<int32_t>> docs;
    std::string line;
    int64_t line_no = 0;
    while (std::getline(in, line)) {
        ++line_no;
        std::istringstream is(line);
        std::vector<int32_t> doc;
        std::string word;
        while (is >> word) {
            size_t used = 0;
            long long v = -1;
            try {
                v = std::stoll(word, &used);
            } catch (const std::exception&) {
                used = 0;
            }
            ST_CHECK(used == word.size() && v >= 0 && v <= INT32_MAX, path, ":", line_no, ": \"",
                     word, "\" is not a token id (non-negative integer)");
            doc.push_back(static_cast<int32_t>(v));
        }
        if (!doc.empty()) docs.push_back(std::move(doc));
    }
    ST_CHECK(!docs.empty(), path, ": no documents (expected one line of token ids per document)");
    return docs;
}

EvalResult evaluate(const std::string& model_dir, const std::vector<std::vector<int32_t>>& docs,
                    const ModelConfig* model_cfg) {
    std::string dir = is_model_dir(model_dir) ? model_dir : resolve_checkpoint(model_dir);
    ModelConfig cfg =
        model_cfg ? *model_cfg : load_hf_config((fs::path(dir) / "config.json").string());
    if (!model_cfg) cfg.mtp_num_layers = 0;  // the depth count is the recipe's: LM loss only
    int64_t longest = 0;
    for (const auto& d : docs) longest = std::max<int64_t>(longest, static_cast<int64_t>(d.size()));
    const int64_t capacity = std::max<int64_t>(256, (longest + 63) / 64 * 64);
    const int64_t max_docs = capacity;
    MemoryPlan plan;
    Glm5Model<float> model(cfg, plan, capacity, max_docs, std::min<int64_t>(capacity, 1024));
    plan.allocate(Device::CPU);
    model.bind();
    load_model_weights(dir, model.params(), plan);
    for (size_t i = 0; i < docs.size(); ++i)
        for (int32_t t : docs[i])
            ST_CHECK(t < cfg.vocab_size, "document ", i + 1, " holds token id ", t,
                     " but the model's vocab_size is ", cfg.vocab_size);

    EvalResult result;
    double loss_sum = 0;
    LossScales sc;
    sc.backward = false;
    sc.mtp.assign(size_t(mtp_loss_slots(cfg)), 1.0);
    std::vector<double> mtp_sum(sc.mtp.size(), 0.0);
    std::vector<int64_t> mtp_rows(sc.mtp.size(), 0);
    MicroBatch mb(capacity, max_docs);
    auto flush = [&] {
        if (mb.num_documents == 0) return;
        model.load_inputs(mb);
        LossSums s = model.forward_backward(sc);
        loss_sum += s.lm_loss_sum;
        result.targets += s.lm_targets;
        for (size_t k = 0; k < mtp_sum.size() && k < s.mtp_sum.size(); ++k)
            mtp_sum[k] += s.mtp_sum[k], mtp_rows[k] += s.mtp_count[k];
        mb.clear();
    };
    for (const auto& d : docs) {
        if (!mb.add_document(d)) {
            flush();
            ST_ASSERT(mb.add_document(d), "document fits an empty micro-batch");
        }
        ++result.documents;
    }
    flush();
    ST_CHECK(result.targets > 0, "no next-token targets: every document has a single token");
    result.lm_loss = loss_sum / double(result.targets);
    result.mtp_loss = reported_mtp_loss(cfg, mtp_sum, mtp_rows);
    return result;
}

}  // namespace sparsetron
