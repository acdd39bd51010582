// tests/head/without_head_test.cc: a build without the fused head (VPCE_WITH_HEAD=OFF): each
// of the head's functions (the loss's and the RL outputs') returns kUnsupported naming itself
// and the option, on every rank, and writes nothing; the loss (every other test of this
// binary) is unaffected.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vpce/vpce.h"

namespace vpce {
namespace {

static_assert(VPCE_WITH_HEAD == 0, "this test is for builds without the fused head");

TEST(WithoutHead, EveryHeadFunctionSaysSoAndWritesNothing) {
  std::vector<float> hidden(4 * 3, 1.0f), weight(5 * 3, 1.0f), loss(4, -7.0f), lse(4, -7.0f), stats(4 * 4, -7.0f);
  std::vector<int64_t> targets = {0, 1, 2, 3};
  const HeadInputs inputs{TensorView::contiguous(hidden.data(), kFloat32, {4, 3}),
                          TensorView::contiguous(weight.data(), kFloat32, {5, 3})};
  const TensorView t = TensorView::contiguous(targets.data(), kInt64, {4});
  const TensorView loss_v = TensorView::contiguous(loss.data(), kFloat32, {4});
  const TensorView lse_v = TensorView::contiguous(lse.data(), kFloat32, {4});
  const VocabShard shard{0, 5, 5};
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  const std::vector<Status> forward = group->run(
      [&](Communicator& comm) { return linear_cross_entropy_forward(comm, inputs, t, shard, {}, {}, loss_v, lse_v); });
  int64_t collectives = -1;
  const std::vector<Status> fused = group->run([&](Communicator& comm) {
    LossOptions sum;
    sum.reduction = Reduction::kSum;
    return linear_cross_entropy_forward_backward(comm, inputs, t, shard, sum, {}, 1.0f,
                                                 TensorView::contiguous(loss.data(), kFloat32, {1}), lse_v, {}, {},
                                                 nullptr, &collectives);
  });
  const Status backward = linear_cross_entropy_backward(inputs, t, lse_v, loss_v, shard, {}, {}, {});
  const Status local = linear_cross_entropy_local_stats(inputs, t, shard, {}, {},
                                                        TensorView::contiguous(stats.data(), kFloat32, {4, 4}));
  const std::pair<Status, const char*> cases[] = {{forward[0], "linear_cross_entropy_forward"},
                                                  {fused[0], "linear_cross_entropy_forward_backward"},
                                                  {backward, "linear_cross_entropy_backward"},
                                                  {local, "linear_cross_entropy_local_stats"}};
  for (const auto& [s, name] : cases) {
    EXPECT_EQ(s.code(), Code::kUnsupported) << name;
    EXPECT_EQ(s.message().find(std::string(name) + ": this build of vpce has no fused head"), 0u) << s.message();
    EXPECT_NE(s.message().find("VPCE_WITH_HEAD=OFF"), std::string::npos) << s.message();
  }
  EXPECT_EQ(collectives, 0);
  for (float v : loss) EXPECT_EQ(v, -7.0f);
  for (float v : lse) EXPECT_EQ(v, -7.0f);
  for (float v : stats) EXPECT_EQ(v, -7.0f);
}

// The RL outputs' head entries (vpce/rl.h) alike; their logits entries are unaffected.
TEST(WithoutHead, EveryRlHeadFunctionSaysSoAndWritesNothing) {
  std::vector<float> hidden(4 * 3, 1.0f), weight(5 * 3, 1.0f), log_prob(4, -7.0f), grad(4 * 3, -7.0f);
  std::vector<double> lse(4, -7.0);
  std::vector<int64_t> targets = {0, 1, 2, 3};
  const HeadInputs inputs{TensorView::contiguous(hidden.data(), kFloat32, {4, 3}),
                          TensorView::contiguous(weight.data(), kFloat32, {5, 3})};
  const TensorView t = TensorView::contiguous(targets.data(), kInt64, {4});
  const TensorView lp = TensorView::contiguous(log_prob.data(), kFloat32, {4});
  const TensorView lse_v = TensorView::contiguous(lse.data(), kFloat64, {4});
  const TensorView grad_v = TensorView::contiguous(grad.data(), kFloat32, {4, 3});
  const VocabShard shard{0, 5, 5};
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  const std::vector<Status> forward = group->run([&](Communicator& comm) {
    return rl::linear_forward(comm, inputs, t, shard, {}, {}, {&lp, nullptr, &lse_v, nullptr});
  });
  int64_t collectives = -1;
  const std::vector<Status> fused = group->run([&](Communicator& comm) {
    return rl::linear_forward_backward(comm, inputs, t, shard, {}, {}, {&lp, nullptr}, {&lp, nullptr, nullptr, nullptr},
                                       {{&grad_v, false}, {}, {}}, nullptr, nullptr, &collectives);
  });
  const Status backward =
      rl::linear_backward(inputs, t, lse_v, nullptr, {&lp, nullptr}, shard, {}, {}, {{&grad_v, false}, {}, {}});
  const std::pair<Status, const char*> cases[] = {
      {forward[0], "rl::linear_forward"}, {fused[0], "rl::linear_forward_backward"}, {backward, "rl::linear_backward"}};
  for (const auto& [s, name] : cases) {
    EXPECT_EQ(s.code(), Code::kUnsupported) << name;
    EXPECT_EQ(s.message().find(std::string(name) + ": this build of vpce has no fused head"), 0u) << s.message();
  }
  EXPECT_EQ(collectives, 0);
  for (float v : log_prob) EXPECT_EQ(v, -7.0f);
  for (double v : lse) EXPECT_EQ(v, -7.0);
  for (float v : grad) EXPECT_EQ(v, -7.0f);
}

}  // namespace
}  // namespace vpce
