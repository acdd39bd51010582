// The consumer: two in-process ranks compute the loss of a 2-token, 4-column problem
// whose answer is known in closed form, through the installed headers and library.
#include <vpce/vpce.h>

#include <cmath>
#include <cstdio>

int main() {
  // Every logit 0: loss = log(4) for each token.
  float logits[2][4] = {};
  long long targets[2] = {0, 3};
  std::unique_ptr<vpce::ThreadGroup> group;
  if (!vpce::ThreadGroup::create(2, &group).ok()) return 1;
  float loss[2][2];
  float lse[2][2];
  const auto results = group->run([&](vpce::Communicator& comm) {
    const int r = comm.rank();
    const vpce::VocabShard shard{2 * r, 2 * r + 2, 4};
    return vpce::forward(comm, vpce::TensorView::matrix(&logits[0][2 * r], vpce::kFloat32, 2, 2, 4),
                         vpce::TensorView::contiguous(targets, vpce::kInt64, {2}), shard, {},
                         vpce::TensorView::contiguous(loss[r], vpce::kFloat32, {2}),
                         vpce::TensorView::contiguous(lse[r], vpce::kFloat32, {2}));
  });
  for (const vpce::Status& s : results) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.to_string().c_str());
      return 1;
    }
  }
  const double want = std::log(4.0);
  const bool ok = std::fabs(loss[0][0] - want) < 1e-6 && std::fabs(loss[1][1] - want) < 1e-6;
  std::printf("vpce %s consumer: loss %.6f (want %.6f): %s\n", VPCE_VERSION_STRING, static_cast<double>(loss[0][0]),
              want, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
