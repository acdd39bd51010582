// bench/c_api_shim.cc: a minimal C entry point into vpce for bench/compare.py (through
// ctypes), until the Python package exists: forward and backward of one rank over a
// contiguous [tokens, vocab] buffer. Returns 0, or 2 with the message in `error`.
#include <cstdio>
#include <memory>

#include "vpce/vpce.h"

extern "C" int vpce_bench_forward_backward(const void* logits, int dtype, int64_t tokens, int64_t vocab,
                                           const int64_t* targets, const float* grad_loss, float* loss, double* lse,
                                           void* grad, int in_place, int threads, char* error, int error_size) {
  const vpce::DataType type = dtype == 0 ? vpce::kFloat32 : dtype == 1 ? vpce::kBFloat16 : vpce::kFloat16;
  static std::unique_ptr<vpce::ThreadGroup> group = [] {
    std::unique_ptr<vpce::ThreadGroup> g;
    (void)vpce::ThreadGroup::create(1, &g);
    return g;
  }();
  static vpce::Workspace workspace;
  vpce::LossOptions options;
  options.num_threads = threads;
  const vpce::VocabShard shard{0, vocab, vocab};
  const auto x = vpce::TensorView::contiguous(logits, type, {tokens, vocab});
  const auto y = vpce::TensorView::contiguous(targets, vpce::kInt64, {tokens});
  const auto l = vpce::TensorView::contiguous(loss, vpce::kFloat32, {tokens});
  const auto e = vpce::TensorView::contiguous(lse, vpce::kFloat64, {tokens});
  vpce::Status s = vpce::forward(group->communicator(0), x, y, shard, options, l, e, {}, &workspace);
  if (s.ok()) {
    const auto g = vpce::TensorView::contiguous(grad_loss, vpce::kFloat32, {tokens});
    const auto out = in_place ? x : vpce::TensorView::contiguous(grad, vpce::kFloat32, {tokens, vocab});
    s = vpce::backward(x, y, e, g, shard, options, out);
  }
  if (s.ok()) return 0;
  std::snprintf(error, static_cast<size_t>(error_size), "%s", s.to_string().c_str());
  return 2;
}
