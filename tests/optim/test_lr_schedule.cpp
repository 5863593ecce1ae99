// The learning-rate schedule against Megatron's OptimizerParamScheduler, written here as Megatron
// runs it: a scheduler object counting samples (warm-up, decay and WSD anneal lengths in
// iterations x global batch size, stepped by the global batch after every update that was not
// skipped), whose rate at the time of an update is the rate that update applies. Every decay
// style, WSD anneal shape, a warm-up start above zero, a decay shorter than the run, and an
// update skipped for non-finite gradients (the schedule waits for the next update); the engine's
// rate of update k must equal the scheduler's after k - 1 steps, to 1e-12 relative. Also the
// trainer: the rate its metrics report per step follows the same rule.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "sparsetron/config/recipe_loader.h"
#include "sparsetron/optim/lr_schedule.h"
#include "sparsetron/runtime/trainer.h"
#include "test_util.h"

using namespace sparsetron;

namespace {

// Megatron's OptimizerParamScheduler.get_lr / step, in samples.
struct MegatronScheduler {
    double init_lr, max_lr, min_lr;
    int64_t warmup_steps, decay_steps, wsd_decay_steps;
    std::string style, wsd_style;
    int64_t num_steps = 0;

    double get_lr() const {
        if (warmup_steps > 0 && num_steps <= warmup_steps)
            return init_lr + (max_lr - init_lr) * double(num_steps) / double(warmup_steps);
        if (style == "constant") return max_lr;
        if (num_steps > decay_steps) return min_lr;
        if (style == "inverse-square-root") {
            const double w = double(std::max<int64_t>(warmup_steps, 1));
            const double n = double(std::max<int64_t>(num_steps, 1));
            return std::max(min_lr, max_lr * std::pow(w, 0.5) / std::pow(n, 0.5));
        }
        const double decay_ratio =
            double(num_steps - warmup_steps) / double(decay_steps - warmup_steps);
        const double delta_lr = max_lr - min_lr;
        double coeff = -1;
        if (style == "linear") {
            coeff = 1.0 - decay_ratio;
        } else if (style == "cosine") {
            coeff = 0.5 * (std::cos(M_PI * decay_ratio) + 1.0);
        } else if (style == "WSD") {
            const int64_t anneal_start = decay_steps - wsd_decay_steps;
            if (num_steps <= anneal_start) {
                coeff = 1.0;
            } else {
                const double r = double(num_steps - anneal_start) / double(wsd_decay_steps);
                if (wsd_style == "linear") coeff = 1.0 - r;
                if (wsd_style == "cosine") coeff = 0.5 * (std::cos(M_PI * r) + 1.0);
                if (wsd_style == "exponential") coeff = 2.0 * std::pow(0.5, r) - 1.0;
                if (wsd_style == "minus_sqrt") coeff = 1.0 - std::sqrt(r);
            }
        }
        EXPECT_GE(coeff, -1e-12) << style << " " << wsd_style;
        return min_lr + coeff * delta_lr;
    }
};

MegatronScheduler megatron_of(const RunConfig& r) {
    const int64_t gbs = r.global_batch_size;
    const int64_t decay = r.lr_decay_iters > 0 ? r.lr_decay_iters : r.train_iters;
    return {r.lr_warmup_init, r.lr,
            r.min_lr,         r.lr_warmup_iters * gbs,
            decay * gbs,      r.lr_wsd_decay_iters * gbs,
            r.lr_decay_style, r.lr_wsd_decay_style};
}

struct Case {
    std::string name;
    std::vector<std::string> sets;
};

}  // namespace

TEST(LrSchedule, MatchesMegatronsSchedulerForEveryStyle) {
    const std::vector<std::string> base = {"lr=2e-3", "min_lr=2e-4", "train_iters=40",
                                           "global_batch_size=8"};
    const std::vector<Case> cases = {
        {"linear, warm-up", {"lr_decay_style=linear", "lr_warmup_iters=5"}},
        {"cosine, warm-up from 1e-4",
         {"lr_decay_style=cosine", "lr_warmup_iters=7", "lr_warmup_init=1e-4"}},
        {"cosine, decay shorter than the run",
         {"lr_decay_style=cosine", "lr_warmup_iters=3", "lr_decay_iters=25"}},
        {"constant, warm-up", {"lr_decay_style=constant", "lr_warmup_iters=4"}},
        {"linear, no warm-up", {"lr_decay_style=linear"}},
        {"inverse square root", {"lr_decay_style=inverse-square-root", "lr_warmup_iters=6"}},
        {"WSD exponential", {"lr_decay_style=WSD", "lr_warmup_iters=4", "lr_wsd_decay_iters=10"}},
        {"WSD linear",
         {"lr_decay_style=WSD", "lr_warmup_iters=4", "lr_wsd_decay_iters=10",
          "lr_wsd_decay_style=linear"}},
        {"WSD cosine",
         {"lr_decay_style=WSD", "lr_wsd_decay_iters=12", "lr_wsd_decay_style=cosine",
          "lr_decay_iters=30"}},
        {"WSD minus_sqrt",
         {"lr_decay_style=WSD", "lr_warmup_iters=2", "lr_wsd_decay_iters=40",
          "lr_wsd_decay_style=minus_sqrt"}},
    };
    for (const Case& c : cases) {
        std::vector<std::string> sets = base;
        sets.insert(sets.end(), c.sets.begin(), c.sets.end());
        const RunConfig r = load_recipe("", sets).run;
        MegatronScheduler m = megatron_of(r);
        double first = 0, last = 0;
        for (int64_t update = 1; update <= 45; ++update) {
            const double want = m.get_lr();  // the rate this update applies
            const double got = learning_rate(r, update);
            ASSERT_NEAR(got, want, 1e-12 * std::max(want, 1e-12))
                << c.name << ", update " << update;
            if (update == 1) first = got;
            last = got;
            m.num_steps += r.global_batch_size;  // the step after a successful update
        }
        // The schedules are not flat where they should not be.
        if (r.lr_decay_style != "constant") {
            EXPECT_NE(first, last) << c.name;
        }
    }
    // Values by hand (linear, warm-up 5, lr 2e-3 to 2e-4 over 40 iterations): update 1 runs at
    // lr_warmup_init (0), update 3 at 2/5 of the rate, update 6 at the peak, update 23 (17 steps
    // into the 35-step decay) at 2e-4 + 18/35 x 1.8e-3, and past the decay at min_lr.
    const RunConfig lin = load_recipe("", {"lr=2e-3", "min_lr=2e-4", "train_iters=40",
                                           "lr_decay_style=linear", "lr_warmup_iters=5"})
                              .run;
    EXPECT_DOUBLE_EQ(learning_rate(lin, 1), 0.0);
    EXPECT_DOUBLE_EQ(learning_rate(lin, 3), 2e-3 * 2 / 5);
    EXPECT_DOUBLE_EQ(learning_rate(lin, 6), 2e-3);
    EXPECT_NEAR(learning_rate(lin, 23), 2e-4 + 18.0 / 35 * 1.8e-3, 1e-15);
    EXPECT_DOUBLE_EQ(learning_rate(lin, 42), 2e-4);
}

// Megatron's defaults for the optimizer's and the schedule's keys (a recipe file that sets none
// of them), and the tiny demo's own values without a file.
TEST(LrSchedule, DefaultsAreMegatrons) {
    const RunConfig d = RunConfig{};
    EXPECT_EQ(d.weight_decay, 0.01);
    EXPECT_EQ(d.adam_beta1, 0.9);
    EXPECT_EQ(d.adam_beta2, 0.999);
    EXPECT_EQ(d.adam_eps, 1e-8);
    EXPECT_EQ(d.clip_grad, 1.0);
    EXPECT_EQ(d.min_lr, 0.0);
    EXPECT_EQ(d.lr_warmup_iters, 0);
    EXPECT_EQ(d.lr_warmup_init, 0.0);
    EXPECT_EQ(d.lr_decay_style, "linear");
    EXPECT_EQ(d.lr_decay_iters, 0);
    EXPECT_EQ(d.lr_wsd_decay_style, "exponential");
    const RunConfig tiny = load_recipe("").run;
    EXPECT_EQ(tiny.lr_decay_style, "cosine");
    EXPECT_EQ(tiny.lr_warmup_iters, 20);
    EXPECT_EQ(tiny.min_lr, 3e-4);
    EXPECT_EQ(tiny.weight_decay, 0.1);
    EXPECT_EQ(tiny.adam_beta2, 0.95);
    // WSD needs its anneal length, as Megatron's scheduler asserts.
    EXPECT_THROW(load_recipe("", {"lr_decay_style=WSD"}), Error);
    EXPECT_THROW(load_recipe("", {"lr_decay_style=WSD", "lr_wsd_decay_iters=500"}), Error);
}

// Through the trainer: each step's reported rate is the rate of its update, and steps skipped
// for non-finite gradients (a rate of 1e30 diverges after the first update) leave the schedule
// where it was (Megatron steps its scheduler only after an update): every skipped step runs at
// update 2's rate, where an iteration-counted schedule would keep decaying.
TEST(LrSchedule, TheTrainerFollowsTheUpdatesNotTheIterations) {
    for (const bool diverge : {false, true}) {
        const Recipe r = load_recipe(
            "", {"train_iters=6", "lr_decay_style=linear", "lr_warmup_iters=0", "eval_interval=0",
                 "skipped_iters_limit=0", diverge ? "lr=1e30" : "lr=1e-3",
                 diverge ? "min_lr=1e29" : "min_lr=1e-4"});
        Trainer t(r, {sparsetron::test::temp_dir(cat("lr-schedule-", diverge)), "", Device::CPU,
                      false, nullptr});
        std::vector<StepMetrics> steps;
        t.run([&](const StepMetrics& m) { steps.push_back(m); });
        ASSERT_EQ(steps.size(), 6u);
        int64_t updates = 0;
        for (const StepMetrics& m : steps) {
            EXPECT_EQ(m.skipped, diverge && m.step > 1) << "step " << m.step;
            EXPECT_DOUBLE_EQ(m.lr, learning_rate(r.run, updates + 1)) << "step " << m.step;
            if (!m.skipped) ++updates;
        }
        EXPECT_DOUBLE_EQ(steps[0].lr, r.run.lr);  // no warm-up: the first update at the peak
        EXPECT_LT(steps[5].lr, steps[0].lr);
        if (diverge) {
            EXPECT_DOUBLE_EQ(steps[5].lr, learning_rate(r.run, 2));
        }
    }
}
