// tests/layout_test.cc: the tensor layouts users pass, against the fp64 oracle: Megatron's
// [s, b, V/R] logits with [s, b] targets and outputs (both leading sizes > 1), as column
// slices of one [s, b, V] buffer, with padded rows, with size-1 dimensions in between; and
// the layouts that cannot be read as rows of one stride (a transposed [b, s] buffer, a gap
// between leading dimensions), which must be rejected by name, not misread.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "support.h"

namespace vpce::test {
namespace {

// Logits for `s` x `b` tokens over V columns, stored at (i, j, v) -> base[i * si + j * sj + v].
struct Layout {
  int64_t s, b, vocab, si, sj;
  std::vector<float> storage;
  std::vector<int64_t> targets;  // [s, b] row-major
  std::vector<float> grad_loss;  // [s, b]

  Layout(int64_t s_, int64_t b_, int64_t vocab_, int64_t si_, int64_t sj_, uint64_t seed)
      : s(s_), b(b_), vocab(vocab_), si(si_), sj(sj_) {
    storage.assign(static_cast<std::size_t>((s - 1) * si + (b - 1) * sj + vocab) + 16, NAN);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::uniform_int_distribution<int64_t> target(0, vocab - 1);
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t j = 0; j < b; ++j) {
        for (int64_t v = 0; v < vocab; ++v) at(i, j, v) = normal(rng);
        targets.push_back(target(rng));
        grad_loss.push_back(0.5f + 0.25f * static_cast<float>((i + j) % 4));
      }
    }
  }
  float& at(int64_t i, int64_t j, int64_t v) { return storage[static_cast<std::size_t>(i * si + j * sj + v)]; }
  // Tokens in [s, b] row-major order, as the oracle sees them.
  std::vector<double> as_rows() {
    std::vector<double> out;
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t j = 0; j < b; ++j) {
        for (int64_t v = 0; v < vocab; ++v) out.push_back(at(i, j, v));
      }
    }
    return out;
  }
};

// Runs R ranks on column slices [s, b, V_r] of `layout` (out of place, [s, b, V] gradient
// buffer) and compares loss and gradient with the oracle.
void expect_matches_oracle(Layout& layout, int ranks, float label_smoothing) {
  const int64_t n = layout.s * layout.b;
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(layout.vocab, ranks));
  const reference::Result want = reference::cross_entropy(layout.as_rows(), n, layout.vocab, layout.targets,
                                                          label_smoothing, widen(layout.grad_loss));
  std::vector<std::vector<float>> loss(static_cast<std::size_t>(ranks),
                                       std::vector<float>(static_cast<std::size_t>(n)));
  std::vector<std::vector<float>> lse = loss;
  std::vector<float> grad(static_cast<std::size_t>(n * layout.vocab), NAN);
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(ranks, &group).ok());
  LossOptions options;
  options.label_smoothing = label_smoothing;
  const std::vector<Status> results = group->run([&](Communicator& comm) -> Status {
    const auto r = static_cast<std::size_t>(comm.rank());
    const VocabShard& shard = shards[r];
    const int64_t cols = shard.vocab_end - shard.vocab_begin;
    const TensorView x = TensorView::strided(&layout.at(0, 0, shard.vocab_begin), kFloat32, {layout.s, layout.b, cols},
                                             {layout.si, layout.sj, 1});
    const TensorView y = TensorView::contiguous(layout.targets.data(), kInt64, {layout.s, layout.b});
    const TensorView l = TensorView::contiguous(loss[r].data(), kFloat32, {layout.s, layout.b});
    const TensorView e = TensorView::contiguous(lse[r].data(), kFloat32, {layout.s, layout.b});
    if (Status st = forward(comm, x, y, shard, options, l, e); !st.ok()) return st;
    const TensorView g = TensorView::contiguous(layout.grad_loss.data(), kFloat32, {layout.s, layout.b});
    const TensorView out = TensorView::strided(grad.data() + shard.vocab_begin, kFloat32, {layout.s, layout.b, cols},
                                               {layout.b * layout.vocab, layout.vocab, 1});
    return backward(x, y, e, g, shard, options, out);
  });
  for (const Status& st : results) ASSERT_TRUE(st.ok()) << st.to_string();
  for (int r = 0; r < ranks; ++r) {
    EXPECT_LT(relative_error(widen(loss[static_cast<std::size_t>(r)]), want.loss), 1e-6) << "rank " << r;
  }
  EXPECT_LT(relative_error(widen(grad), want.grad), 1e-5);
}

TEST(Layout, MegatronSbvContiguous) {
  Layout layout(3, 4, 101, 4 * 101, 101, 1);
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE("R " + std::to_string(ranks));
    expect_matches_oracle(layout, ranks, 0.0f);
    expect_matches_oracle(layout, ranks, 0.1f);
  }
}

TEST(Layout, PaddedRows) {
  // Each token's row padded to 128 columns, as an allocator aligning rows would.
  Layout layout(5, 2, 100, 2 * 128, 128, 2);
  expect_matches_oracle(layout, 3, 0.0f);
}

TEST(Layout, SizeOneDimensionsInBetween) {
  const int64_t vocab = 64;
  std::vector<float> logits(static_cast<std::size_t>(2 * 3 * vocab));
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (float& v : logits) v = normal(rng);
  std::vector<int64_t> targets = {0, 63, 5, 17, 32, 40};
  std::vector<float> loss(6), lse(6);
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  // [2, 1, 3, 1, V] with strides that are meaningless on the size-1 dimensions.
  const TensorView x =
      TensorView::strided(logits.data(), kFloat32, {2, 1, 3, 1, vocab}, {3 * vocab, 12345, vocab, -7, 1});
  const TensorView y = TensorView::strided(targets.data(), kInt64, {2, 1, 3}, {3, 999, 1});
  const Status st = group->run([&](Communicator& comm) {
    return forward(comm, x, y, {0, vocab, vocab}, {}, TensorView::contiguous(loss.data(), kFloat32, {6}),
                   TensorView::contiguous(lse.data(), kFloat32, {6}));
  })[0];
  ASSERT_TRUE(st.ok()) << st.to_string();
  std::vector<double> rows(logits.begin(), logits.end());
  const reference::Result want = reference::cross_entropy(rows, 6, vocab, targets, 0.0, std::vector<double>(6, 1.0));
  EXPECT_LT(relative_error(widen(loss), want.loss), 1e-6);
}

// A layout whose leading dimensions do not collapse to one row stride is an error that
// names the dimension, never a misread.
void expect_rejected(const TensorView& x, const TensorView& y, const std::string& words) {
  std::vector<float> loss(12, -5.0f), lse(12, -5.0f);
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  const Status st = group->run([&](Communicator& comm) {
    return forward(comm, x, y, {0, x.shape[2], x.shape[2]}, {}, TensorView::contiguous(loss.data(), kFloat32, {3, 4}),
                   TensorView::contiguous(lse.data(), kFloat32, {3, 4}));
  })[0];
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find(words), std::string::npos) << st.to_string();
  for (float v : loss) EXPECT_EQ(v, -5.0f);
}

TEST(Layout, TransposedBufferIsRejected) {
  // A [b = 4, s = 3, V] buffer viewed as [s, b, V]: rows are not evenly spaced.
  const int64_t vocab = 10;
  std::vector<float> logits(static_cast<std::size_t>(12 * vocab), 0.5f);
  std::vector<int64_t> targets(12, 1);
  expect_rejected(TensorView::strided(logits.data(), kFloat32, {3, 4, vocab}, {vocab, 3 * vocab, 1}),
                  TensorView::contiguous(targets.data(), kInt64, {3, 4}), "logits.strides[0]");
  // Targets stored [b, s] and viewed as [s, b].
  expect_rejected(TensorView::contiguous(logits.data(), kFloat32, {3, 4, vocab}),
                  TensorView::strided(targets.data(), kInt64, {3, 4}, {1, 3}), "targets.strides[0]");
}

TEST(Layout, GapBetweenLeadingDimensionsIsRejected) {
  const int64_t vocab = 10;
  std::vector<float> logits(static_cast<std::size_t>(3 * (4 * vocab + 3)), 0.5f);
  std::vector<int64_t> targets(12, 1);
  expect_rejected(TensorView::strided(logits.data(), kFloat32, {3, 4, vocab}, {4 * vocab + 3, vocab, 1}),
                  TensorView::contiguous(targets.data(), kInt64, {3, 4}), "logits.strides[0]");
}

}  // namespace
}  // namespace vpce::test
