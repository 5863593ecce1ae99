// The expert exchange's transport (parallel/expert/exchange_transport.h): auto follows where the
// expert-parallel ranks run, a forced transport is taken or refused with the reason, and the
// recipe key is validated.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/parallel/expert/exchange_transport.h"
#include "test_util.h"

using namespace sparsetron;

TEST(ExchangeTransport, AutoTakesNvlinkOnOneHostAndNcclAcrossHosts) {
    const std::vector<uint64_t> one_node(8, 42), two_nodes = {7, 7, 7, 7, 9, 9, 9, 9};
    EXPECT_EQ(choose_exchange_transport("auto", one_node), ExchangeTransport::Nvlink);
    EXPECT_EQ(choose_exchange_transport("auto", two_nodes), ExchangeTransport::Nccl);
    EXPECT_EQ(choose_exchange_transport("auto", {this_host_id()}), ExchangeTransport::Nvlink);
    EXPECT_STREQ(transport_name(ExchangeTransport::Nccl), "nccl");
    EXPECT_STREQ(transport_name(ExchangeTransport::Nvlink), "nvlink");
}

TEST(ExchangeTransport, AForcedTransportIsTakenOrRefusedWithTheRanks) {
    EXPECT_EQ(choose_exchange_transport("nccl", std::vector<uint64_t>(4, 1)),
              ExchangeTransport::Nccl);
    EXPECT_EQ(choose_exchange_transport("nvlink", std::vector<uint64_t>(4, 1)),
              ExchangeTransport::Nvlink);
    const std::string msg = test::error_of([] {
        choose_exchange_transport("nvlink", {3, 3, 5, 3});
    });
    EXPECT_NE(msg.find("ranks 0 and 2 of the expert-parallel group are on different hosts"),
              std::string::npos)
        << msg;
    const std::string bad = test::error_of([] { choose_exchange_transport("ipc", {1}); });
    EXPECT_NE(bad.find("\"ipc\" is not one of auto, nvlink, nccl"), std::string::npos) << bad;
}

TEST(ExchangeTransport, TheRecipeKeyIsReadAndChecked) {
    EXPECT_EQ(load_recipe("", {"moe_expert_exchange=nccl"}).run.moe_expert_exchange, "nccl");
    EXPECT_EQ(load_recipe("").run.moe_expert_exchange, "auto");
    const std::string msg = test::error_of([] { load_recipe("", {"moe_expert_exchange=mpi"}); });
    EXPECT_NE(msg.find("moe_expert_exchange"), std::string::npos) << msg;
}
