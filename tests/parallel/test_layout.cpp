// Process-group layout, CP sharding of THD documents, the dynamic-CP packing and the EP exchange
// on one process (the communicators and the multi-rank exchange run under mpirun in test_mpi).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "parallel/ep_exchange_check.h"
#include "sparsetron/config/pipeline_layout.h"
#include "sparsetron/config/pipeline_split.h"
#include "sparsetron/config/recipe.h"
#include "sparsetron/core/error.h"
#include "sparsetron/core/rng.h"
#include "sparsetron/parallel/context/cp_shard.h"
#include "sparsetron/parallel/context/dynamic_cp.h"
#include "sparsetron/parallel/context/dynamic_cp_batches.h"
#include "sparsetron/parallel/layout/layout.h"

namespace sparsetron {
namespace {

RunConfig sizes(int64_t cp, int64_t ep) {
    RunConfig r;
    r.context_parallel_size = cp;
    r.expert_model_parallel_size = ep;
    return r;
}

// Each kind of group partitions the ranks, every member agrees on its group, and the sizes are
// the layout's.
TEST(ParallelLayout, GroupsPartitionTheRanks) {
    const ParallelLayout l = make_layout(sizes(2, 4), 16);
    EXPECT_EQ(l.dp, 8);
    EXPECT_EQ(l.edp(), 4);
    using Fn = std::vector<int> (ParallelLayout::*)(int) const;
    for (Fn fn : {&ParallelLayout::cp_group, &ParallelLayout::dp_group, &ParallelLayout::ep_group,
                  &ParallelLayout::edp_group}) {
        std::multiset<int> seen;
        for (int r = 0; r < 16; ++r) {
            const auto g = (l.*fn)(r);
            EXPECT_TRUE(std::find(g.begin(), g.end(), r) != g.end());
            for (int m : g) EXPECT_EQ((l.*fn)(m), g) << "rank " << m << " disagrees";
            if (g.front() == r) seen.insert(g.begin(), g.end());
        }
        EXPECT_EQ(seen.size(), 16u);
        EXPECT_EQ(std::set<int>(seen.begin(), seen.end()).size(), 16u);
    }
    // CP fastest for dense layers, EP fastest for experts (Megatron's rank order).
    EXPECT_EQ(l.cp_group(5), (std::vector<int>{4, 5}));
    EXPECT_EQ(l.dp_group(5), (std::vector<int>{1, 3, 5, 7, 9, 11, 13, 15}));
    EXPECT_EQ(l.ep_group(5), (std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(l.edp_group(5), (std::vector<int>{1, 5, 9, 13}));
    // Colors give the same partition as the member lists.
    for (int a = 0; a < 16; ++a)
        for (int b = 0; b < 16; ++b) {
            EXPECT_EQ(l.cp_color(a) == l.cp_color(b), l.cp_group(a) == l.cp_group(b));
            EXPECT_EQ(l.ep_color(a) == l.ep_color(b), l.ep_group(a) == l.ep_group(b));
        }
    EXPECT_EQ(l.dynamic_cp_group(5, 4), (std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(l.dynamic_cp_sizes(2), (std::vector<int>{2, 4, 8, 16}));
}

// Pipeline stages are the slowest dimension: each stage's ranks are contiguous and every group
// but the pipeline and embedding groups stays inside one stage, laid out there as without stages.
TEST(ParallelLayout, PipelineStagesAreTheSlowestDimension) {
    RunConfig r = sizes(2, 2);
    r.pipeline_model_parallel_size = 2;
    const ParallelLayout l = make_layout(r, 8);
    EXPECT_EQ(l.stage_size(), 4);
    EXPECT_EQ(l.dp, 2);
    EXPECT_EQ(l.edp(), 2);
    EXPECT_EQ(l.pp_rank(5), 1);
    EXPECT_EQ(l.stage_rank(5), 1);
    EXPECT_EQ(l.cp_group(5), (std::vector<int>{4, 5}));
    EXPECT_EQ(l.dp_group(5), (std::vector<int>{5, 7}));
    EXPECT_EQ(l.ep_group(6), (std::vector<int>{6, 7}));
    EXPECT_EQ(l.edp_group(6), (std::vector<int>{4, 6}));
    EXPECT_EQ(l.stage_group(5), (std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(l.pp_group(5), (std::vector<int>{1, 5}));
    EXPECT_EQ(l.dynamic_cp_group(5, 4), (std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(l.dynamic_cp_sizes(1), (std::vector<int>{1, 2, 4}));
    using Fn = std::vector<int> (ParallelLayout::*)(int) const;
    using Color = int (ParallelLayout::*)(int) const;
    const std::pair<Fn, Color> kinds[] = {
        {&ParallelLayout::cp_group, &ParallelLayout::cp_color},
        {&ParallelLayout::dp_group, &ParallelLayout::dp_color},
        {&ParallelLayout::ep_group, &ParallelLayout::ep_color},
        {&ParallelLayout::edp_group, &ParallelLayout::edp_color},
        {&ParallelLayout::stage_group, &ParallelLayout::stage_color},
        {&ParallelLayout::pp_group, &ParallelLayout::pp_color}};
    for (const auto& [group, color] : kinds)
        for (int a = 0; a < 8; ++a) {
            const auto g = (l.*group)(a);
            EXPECT_TRUE(std::find(g.begin(), g.end(), a) != g.end());
            for (int b = 0; b < 8; ++b)
                EXPECT_EQ((l.*color)(a) == (l.*color)(b), (l.*group)(a) == (l.*group)(b))
                    << "ranks " << a << " and " << b;
            if (group != &ParallelLayout::pp_group) {
                for (int m : g) EXPECT_EQ(l.pp_rank(m), l.pp_rank(a)) << "a group crosses stages";
            }
        }
    // The embedding pairs: the first and last stages' ranks of equal stage rank; middle stages
    // alone.
    r.pipeline_model_parallel_size = 4;
    r.context_parallel_size = 1, r.expert_model_parallel_size = 1;
    const ParallelLayout l4 = make_layout(r, 8);
    EXPECT_EQ(l4.embedding_color(1), l4.embedding_color(7));
    EXPECT_NE(l4.embedding_color(0), l4.embedding_color(7));
    for (int m = 0; m < 8; ++m)
        if (m != 3) {
            EXPECT_NE(l4.embedding_color(3), l4.embedding_color(m));
        }
}

// Megatron's layer split: the first/last stages' counts as given, the rest even.
TEST(PipelineSplit, LayersPerStage) {
    EXPECT_EQ(pipeline_layer_counts(78, 4, 18, 0), (std::vector<int64_t>{18, 20, 20, 20}));
    EXPECT_EQ(pipeline_layer_counts(4, 4, 0, 0), (std::vector<int64_t>{1, 1, 1, 1}));
    EXPECT_EQ(pipeline_layer_counts(4, 2, 0, 3), (std::vector<int64_t>{1, 3}));
    EXPECT_EQ(pipeline_layer_counts(10, 4, 2, 2), (std::vector<int64_t>{2, 3, 3, 2}));
    EXPECT_EQ(pipeline_layer_counts(7, 1, 0, 0), (std::vector<int64_t>{7}));
    try {
        pipeline_layer_counts(5, 2, 0, 0);
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("decoder_first_pipeline_num_layers"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_THROW(pipeline_layer_counts(78, 4, 17, 0), Error);  // 61 over 3 stages
    EXPECT_THROW(pipeline_layer_counts(3, 4, 0, 0), Error);    // a stage without layers
    EXPECT_THROW(pipeline_layer_counts(4, 2, 2, 3), Error);    // more than num_layers
}

TEST(ParallelLayout, SizesThatDoNotDivideAreNamed) {
    try {
        make_layout(sizes(3, 1), 16);
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("context_parallel_size 3"), std::string::npos);
    }
    try {
        make_layout(sizes(1, 32), 16);
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("expert_model_parallel_size 32"), std::string::npos);
    }
    EXPECT_THROW(make_layout(sizes(1, 1), 16).dynamic_cp_group(0, 3), Error);
}

// Chunks r and 2cp-1-r: every row exactly once, and equal causal work on every rank.
TEST(CpShard, TwoChunksPerRankCoverTheDocumentWithEqualWork) {
    for (int cp : {1, 2, 4, 8}) {
        const int64_t L = 4096;
        std::vector<int> owner(size_t(L), -1);
        int64_t pairs0 = -1;
        for (int r = 0; r < cp; ++r) {
            const auto rows = cp_rows(L, cp, r);
            ASSERT_EQ(rows.size(), 2u);
            EXPECT_EQ(rows[0].begin, r * L / (2 * cp));
            EXPECT_EQ(rows[1].end, (2 * cp - r) * L / (2 * cp));
            for (int64_t p : cp_positions(L, cp, r)) {
                EXPECT_EQ(owner[size_t(p)], -1) << "row " << p << " twice";
                owner[size_t(p)] = r;
            }
            const int64_t pairs = cp_causal_pairs(L, cp, r);
            if (pairs0 < 0) pairs0 = pairs;
            EXPECT_EQ(pairs, pairs0) << "cp " << cp << " rank " << r;
        }
        EXPECT_EQ(std::count(owner.begin(), owner.end(), -1), 0);
    }
    // A length that does not divide: the last chunks are short, nothing is lost.
    int64_t total = 0;
    for (int r = 0; r < 4; ++r) total += int64_t(cp_positions(1001, 4, r).size());
    EXPECT_EQ(total, 1001);
}

// cp_local_tokens bounds the rows a CP rank takes of any packing: random documents filling a
// micro-batch, every rank's rows counted.
TEST(CpShard, PlannedRowsHoldEveryRanksChunks) {
    CounterRng rng(3, 9);
    uint64_t draw = 0;
    for (int trial = 0; trial < 200; ++trial) {
        const int64_t tokens = 64 + int64_t(rng.bits(draw++) % 512), docs = 1 + trial % 9;
        const int cp = 1 << (trial % 4);
        std::vector<int64_t> lengths;
        int64_t used = 0;
        while (int64_t(lengths.size()) < docs && used < tokens) {
            const int64_t len =
                std::min<int64_t>(tokens - used, 1 + int64_t(rng.bits(draw++) % 97));
            lengths.push_back(len);
            used += len;
        }
        const int64_t planned = cp_local_tokens(tokens, docs, cp);
        EXPECT_LE(planned, tokens);
        for (int r = 0; r < cp; ++r) {
            int64_t rows = 0;
            for (int64_t len : lengths) rows += int64_t(cp_positions(len, cp, r).size());
            EXPECT_LE(rows, planned) << "tokens " << tokens << " docs " << docs << " cp " << cp;
        }
    }
    EXPECT_EQ(cp_local_tokens(4096, 64, 1), 4096);
    EXPECT_EQ(cp_local_tokens(4096, 8, 2), 2048 + 16);
}

TEST(DynamicCp, SizeIsTheSmallestPowerOfTwoThatFits) {
    EXPECT_EQ(dynamic_cp_size(4096, 4096), 1);
    EXPECT_EQ(dynamic_cp_size(4097, 4096), 2);
    EXPECT_EQ(dynamic_cp_size(32768, 4096), 8);
    EXPECT_EQ(dynamic_cp_size(20000, 4096), 8);  // 5 ranks round up to 8
    EXPECT_EQ(dynamic_cp_size(100, 4096, 2), 2);
}

// The seed's long-context proxy: two 32K samples, 4096 tokens per rank over 16 DP x CP ranks:
// one micro-batch, two CP8 groups, no idle rank.
TEST(DynamicCp, TheSeedRecipeGivesTwoCp8Groups) {
    const auto mbs = schedule_dynamic_cp({32768, 32768}, 16, 4096);
    ASSERT_EQ(mbs.size(), 1u);
    ASSERT_EQ(mbs[0].groups.size(), 2u);
    EXPECT_EQ(mbs[0].groups[0].first_rank, 0);
    EXPECT_EQ(mbs[0].groups[0].size, 8);
    EXPECT_EQ(mbs[0].groups[1].first_rank, 8);
    EXPECT_EQ(mbs[0].groups[1].size, 8);
    EXPECT_EQ(mbs[0].idle_ranks, 0);
}

// Random lengths: every sample scheduled once, groups aligned powers of two, disjoint, within
// capacity and at least as large as each member needs.
TEST(DynamicCp, PackingInvariantsOnRandomSamples) {
    CounterRng rng(41, 0);
    for (int trial = 0; trial < 20; ++trial) {
        std::vector<int64_t> lengths(size_t(5 + trial * 7));
        for (size_t i = 0; i < lengths.size(); ++i)
            lengths[i] = 1 + int64_t(rng.bits(uint64_t(trial * 1000 + i)) % 32768);
        const int ranks = 16;
        const int64_t cap = 4096;
        const auto mbs = schedule_dynamic_cp(lengths, ranks, cap);
        std::vector<int> seen(lengths.size(), 0);
        for (const auto& mb : mbs) {
            std::vector<int> used(size_t(ranks), 0);
            int busy = 0;
            for (const auto& g : mb.groups) {
                EXPECT_TRUE(g.size > 0 && (g.size & (g.size - 1)) == 0);
                EXPECT_EQ(g.first_rank % g.size, 0);
                ASSERT_LE(g.first_rank + g.size, ranks);
                for (int r = g.first_rank; r < g.first_rank + g.size; ++r) ++used[size_t(r)];
                busy += g.size;
                int64_t tokens = 0;
                for (int s : g.samples) {
                    ++seen[size_t(s)];
                    tokens += lengths[size_t(s)];
                    EXPECT_GE(g.size, dynamic_cp_size(lengths[size_t(s)], cap));
                }
                EXPECT_EQ(tokens, g.tokens);
                EXPECT_LE(tokens, int64_t(g.size) * cap);
                EXPECT_FALSE(g.samples.empty());
            }
            for (int u : used) EXPECT_LE(u, 1) << "overlapping groups";
            EXPECT_EQ(mb.idle_ranks, ranks - busy);
        }
        for (int c : seen) EXPECT_EQ(c, 1);
    }
}

// Two one-rank samples on 4 ranks open ranks 0 and 1; each one's neighbour block is the other,
// so neither doubles and ranks 2-3 stay idle (the trainer runs empty micro-batches there when
// expert parallelism needs every rank in every exchange).
TEST(DynamicCp, GroupsThatCannotDoubleLeaveRanksIdle) {
    const auto mbs = schedule_dynamic_cp({50, 40}, 4, 64);
    ASSERT_EQ(mbs.size(), 1u);
    ASSERT_EQ(mbs[0].groups.size(), 2u);
    EXPECT_EQ(mbs[0].groups[0].first_rank, 0);
    EXPECT_EQ(mbs[0].groups[1].first_rank, 1);
    EXPECT_EQ(mbs[0].groups[0].size, 1);
    EXPECT_EQ(mbs[0].groups[1].size, 1);
    EXPECT_EQ(mbs[0].idle_ranks, 2);
    // One sample alone doubles into every rank.
    const auto one = schedule_dynamic_cp({50}, 4, 64);
    EXPECT_EQ(one[0].groups[0].size, 4);
    EXPECT_EQ(one[0].idle_ranks, 0);
}

TEST(DynamicCp, ShortSamplesShareRanksAndOversizeOnesAreNamed) {
    // 16 samples of 1000 tokens on 4 ranks of 4096: four per rank, one micro-batch.
    const auto mbs = schedule_dynamic_cp(std::vector<int64_t>(16, 1000), 4, 4096);
    ASSERT_EQ(mbs.size(), 1u);
    EXPECT_EQ(mbs[0].groups.size(), 4u);
    for (const auto& g : mbs[0].groups) EXPECT_EQ(g.samples.size(), 4u);
    try {
        schedule_dynamic_cp({70000}, 16, 4096);
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("raise max_seqlen_per_dp_cp_rank"), std::string::npos);
    }
}

// The EP exchange on one process: every expert is local, the result is the local computation.
// One rank's step under dynamic CP: three 30-token documents at 40 tokens per rank take a
// micro-batch each; for interleaved pipeline stages over 2 ranks the step is padded with one empty
// micro-batch (no documents, no CP group) to 4.
TEST(DynamicCp, ARanksStepIsPaddedToTheMultipleWithEmptyMicroBatches) {
    RunConfig run;
    run.max_seqlen_per_dp_cp_rank = 40;
    std::vector<MicroBatch> batches;
    batches.emplace_back(128, 8);
    for (int d = 0; d < 3; ++d)
        ASSERT_TRUE(batches[0].add_document(std::vector<int32_t>(30, 7 + d)));
    for (const int64_t multiple : {1, 2, 4}) {
        DynamicCpBatches b(run, 40, 8, nullptr, 0, 1, multiple);
        const DynamicCpBatches::Step step = b.schedule(batches);
        const size_t want = multiple == 1 ? 3 : 4;
        ASSERT_EQ(step.micro_batches.size(), want) << "multiple " << multiple;
        ASSERT_EQ(step.cp_groups.size(), want);
        for (size_t i = 0; i < want; ++i) {
            EXPECT_EQ(step.cp_groups[i], nullptr);
            EXPECT_EQ(step.micro_batches[i]->num_documents, i < 3 ? 1 : 0)
                << "micro-batch " << i << " of multiple " << multiple;
        }
    }
}

TEST(EpDispatch, OneProcessExchangeMatchesTheLocalComputation) {
    SingleProcessComm comm;
    test::check_ep_exchange(comm);
    std::vector<int32_t> topk = {0, 9};
    EXPECT_THROW(plan_ep_dispatch(comm, topk.data(), 1, 2, 8), Error);  // expert 9 of 8
}

// Megatron's layout string: `|` ends a stage, `X*N` and `(...)*N` repeat (a group may hold `|`),
// commas and spaces are cosmetic, empty stages parse.
TEST(PipelineLayout, GrammarExpandsToStages) {
    using V = std::vector<std::string>;
    EXPECT_EQ(parse_pipeline_layout("Et*3|(tt|)*2,m|L"), (V{"Ettt", "tt", "tt", "m", "L"}));
    EXPECT_EQ(parse_pipeline_layout("E||t|L"), (V{"E", "", "t", "L"}));
    EXPECT_EQ(parse_pipeline_layout(" E t , t | t t m L "), (V{"Ett", "ttmL"}));
    EXPECT_EQ(parse_pipeline_layout("E(t(t)*2|)*2L"), (V{"Ettt", "ttt", "L"}));
    EXPECT_EQ(parse_pipeline_layout("Et*12|t*0L"), (V{"Etttttttttttt", "L"}));
    for (const char* bad : {"Et*|L", "*3Et|L", "Ex|tL", "E(t|L", "Et)|L", "E t * | L"}) {
        try {
            parse_pipeline_layout(bad);
            ADD_FAILURE() << bad << " parsed";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("pipeline_model_parallel_layout"),
                      std::string::npos)
                << e.what();
        }
    }
}

// A layout's decoder layers per stage, and what the engine refuses with its reason: the seed's
// 256-GPU split written as a layout equals decoder_first_pipeline_num_layers 18.
TEST(PipelineLayout, CountsPerStageAgainstTheModel) {
    EXPECT_EQ(pipeline_layout_counts("Et*18|t*20|t*20|t*20,m*7,L", 78, 7, 4),
              pipeline_layer_counts(78, 4, 18, 0));
    EXPECT_EQ(pipeline_layout_counts("Et|tttmL", 4, 1, 2), (std::vector<int64_t>{1, 3}));
    EXPECT_EQ(pipeline_layout_counts("EtttL", 3, 0, 1), (std::vector<int64_t>{3}));
    const auto refused = [](const char* layout, int64_t layers, int64_t mtp, int64_t pp,
                            const char* why) {
        try {
            pipeline_layout_counts(layout, layers, mtp, pp);
            ADD_FAILURE() << layout << " accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
        }
    };
    refused("Et*3|(tt|)*29,m|L", 61, 1, 16, "32 stages where 16 are planned");
    refused("Et|t|tL", 3, 0, 2, "3 stages where 2 are planned");
    refused("tE|tL", 2, 0, 2, "the embedding (E) must appear once, first in the first stage");
    refused("Et|Lt", 2, 0, 2, "the loss (L) must appear once, last in the last stage");
    refused("Et|ttL", 4, 0, 2, "3 decoder layers (t), num_layers is 4");
    refused("Et|tmL", 2, 2, 2, "1 MTP layers (m), mtp_num_layers is 2");
    refused("Etm|tL", 2, 1, 2, "the MTP layers (m) must be in the last stage");
    refused("Et||tL", 2, 0, 3, "stage 1 holds no decoder layer");
    refused("Et|tmtL", 3, 1, 2, "a decoder layer (t) after an MTP layer (m)");
}

// The layout and the first/last keys both split the layers: a recipe sets one.
TEST(PipelineLayout, RecipeKeyIsExclusiveWithTheFirstLastKeys) {
    Recipe r = builtin_tiny_recipe();
    r.run.pipeline_model_parallel_size = 2;
    r.run.world_size = 2;
    r.run.pipeline_model_parallel_layout =
        "Et|t" + std::string(size_t(r.model.mtp_num_layers), 'm') + "L";
    EXPECT_EQ(pipeline_stage_layers(r.model, r.run), (std::vector<int64_t>{1, 1}));
    EXPECT_EQ(pipeline_stage(r.model, r.run, 1).first_layer, 1);
    r.run.decoder_first_pipeline_num_layers = 1;
    try {
        pipeline_stage_layers(r.model, r.run);
        ADD_FAILURE() << "both keys accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("set one"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace sparsetron

// Interleaved virtual stages: V chunks per rank from any of Megatron's three ways to say it, the
// model cut into V x P stages, rank r holding stages r, P + r, ... (every rank's first chunk, then
// every rank's second); the keys that would contradict each other are refused by name.
TEST(PipelineLayout, VirtualStagesPerRankFromEachKey) {
    Recipe r = builtin_tiny_recipe();
    r.model.num_layers = 8;
    r.model.moe_layer_pattern.assign(8, 1);
    r.run.pipeline_model_parallel_size = 2;
    r.run.world_size = 2;
    EXPECT_EQ(pipeline_virtual_stages(r.model, r.run), 1);
    r.run.num_virtual_stages_per_pipeline_rank = 2;
    EXPECT_EQ(pipeline_virtual_stages(r.model, r.run), 2);
    EXPECT_EQ(pipeline_stage_layers(r.model, r.run), (std::vector<int64_t>{2, 2, 2, 2}));
    const std::vector<PipelineStage> rank1 = pipeline_rank_stages(r.model, r.run, 1);
    ASSERT_EQ(rank1.size(), 2u);
    EXPECT_EQ(rank1[0].index, 1);
    EXPECT_EQ(rank1[0].count, 4);
    EXPECT_EQ(rank1[0].first_layer, 2);
    EXPECT_EQ(rank1[0].end_layer, 4);
    EXPECT_EQ(rank1[1].index, 3);
    EXPECT_TRUE(rank1[1].last());
    EXPECT_EQ(rank1[1].first_layer, 6);
    r.run.num_virtual_stages_per_pipeline_rank = 0;
    r.run.num_layers_per_virtual_pipeline_stage = 1;
    EXPECT_EQ(pipeline_virtual_stages(r.model, r.run), 4);
    r.run.num_layers_per_virtual_pipeline_stage = 0;
    r.run.pipeline_model_parallel_layout =
        "Ett|t|ttt|tt" + std::string(size_t(r.model.mtp_num_layers), 'm') + "L";
    EXPECT_EQ(pipeline_virtual_stages(r.model, r.run), 2);
    EXPECT_EQ(pipeline_stage_layers(r.model, r.run), (std::vector<int64_t>{2, 1, 3, 2}));
    EXPECT_EQ(pipeline_rank_stages(r.model, r.run, 0)[1].first_layer, 3);
    const auto refused = [&](const RunConfig& run, const char* why) {
        try {
            pipeline_virtual_stages(r.model, run);
            ADD_FAILURE() << "accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
        }
    };
    RunConfig both = r.run;
    both.pipeline_model_parallel_layout.clear();
    both.num_virtual_stages_per_pipeline_rank = 2;
    both.num_layers_per_virtual_pipeline_stage = 2;
    refused(both, "set one");
    RunConfig disagree = r.run;
    disagree.num_virtual_stages_per_pipeline_rank = 4;
    refused(disagree, "the virtual-stage key says 4");
    RunConfig uneven = r.run;
    uneven.pipeline_model_parallel_layout.clear();
    uneven.num_virtual_stages_per_pipeline_rank = 2;
    uneven.decoder_first_pipeline_num_layers = 1;
    refused(uneven, "give the split as pipeline_model_parallel_layout");
}
