// The installed library called from inside the program's own OpenMP team: each of 8
// threads computes the fused head's statistics of its own problem
// (linear_cross_entropy_local_stats, num_threads 1 and 2, 600 tokens: two token blocks)
// and the loss kernels' statistics of the same logits built here (calculate_local_stats);
// they must agree (in a build without the head, the loss's statistics on one thread stand
// in for the head's). A per-thread buffer indexed by the caller's thread number crashed here.
#include <omp.h>
#include <vpce/vpce.h>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

constexpr int64_t kTokens = 600, kHidden = 16, kVocab = 50;

// Thread t's problem: hidden and weight from a cheap deterministic sequence.
float value(int t, int64_t i) { return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + t)) * 0.5f; }

bool one_thread_agrees(int t, int num_threads) {
  std::vector<float> hidden(kTokens * kHidden), weight(kVocab * kHidden), logits(kTokens * kVocab);
  std::vector<long long> targets(kTokens);
  for (int64_t i = 0; i < kTokens * kHidden; ++i) hidden[i] = value(t, i);
  for (int64_t i = 0; i < kVocab * kHidden; ++i) weight[i] = value(t + 100, i);
  for (int64_t i = 0; i < kTokens; ++i) {
    targets[i] = (i * 7 + t) % kVocab;
    for (int64_t v = 0; v < kVocab; ++v) {
      double sum = 0.0;
      for (int64_t k = 0; k < kHidden; ++k) sum += double{hidden[i * kHidden + k]} * weight[v * kHidden + k];
      logits[i * kVocab + v] = static_cast<float>(sum);
    }
  }
  const vpce::VocabShard shard{0, kVocab, kVocab};
  vpce::LossOptions options;
  options.num_threads = num_threads;
  const vpce::TensorView y = vpce::TensorView::contiguous(targets.data(), vpce::kInt64, {kTokens});
  std::vector<float> head_stats(kTokens * 4), loss_stats(kTokens * 4);
#if VPCE_WITH_HEAD
  const vpce::HeadInputs in{vpce::TensorView::contiguous(hidden.data(), vpce::kFloat32, {kTokens, kHidden}),
                            vpce::TensorView::contiguous(weight.data(), vpce::kFloat32, {kVocab, kHidden})};
  const vpce::Status a = vpce::linear_cross_entropy_local_stats(
      in, y, shard, options, {}, vpce::TensorView::contiguous(head_stats.data(), vpce::kFloat32, {kTokens, 4}));
#else  // a build without the fused head: the loss's own statistics on one thread instead
  vpce::LossOptions one_thread = options;
  one_thread.num_threads = 1;
  const vpce::Status a = vpce::calculate_local_stats(
      vpce::TensorView::contiguous(logits.data(), vpce::kFloat32, {kTokens, kVocab}), y, shard, one_thread,
      vpce::TensorView::contiguous(head_stats.data(), vpce::kFloat32, {kTokens, 4}));
#endif
  const vpce::Status b = vpce::calculate_local_stats(
      vpce::TensorView::contiguous(logits.data(), vpce::kFloat32, {kTokens, kVocab}), y, shard, options,
      vpce::TensorView::contiguous(loss_stats.data(), vpce::kFloat32, {kTokens, 4}));
  if (!a.ok() || !b.ok()) {
    std::fprintf(stderr, "thread %d: %s %s\n", t, a.to_string().c_str(), b.to_string().c_str());
    return false;
  }
  for (int64_t i = 0; i < kTokens * 4; ++i) {
    if (!(std::fabs(head_stats[i] - loss_stats[i]) <= 1e-5f * (1.0f + std::fabs(loss_stats[i])))) {
      std::fprintf(stderr, "thread %d, num_threads %d: statistic %lld is %g, the logits give %g\n", t, num_threads,
                   static_cast<long long>(i), double{head_stats[i]}, double{loss_stats[i]});
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
  int wrong = 0;
  for (int num_threads : {1, 2}) {
#pragma omp parallel num_threads(8) reduction(+ : wrong)
    wrong += one_thread_agrees(omp_get_thread_num(), num_threads) ? 0 : 1;
  }
  std::printf("vpce %s inside an OpenMP team of 8: %s\n", VPCE_VERSION_STRING, wrong == 0 ? "ok" : "WRONG");
  return wrong == 0 ? 0 : 1;
}
