// tests/cuda/cuda_step.h: one forward and backward of a logits problem on the device over a
// communicator, run eagerly on `warm_up` (which grows the workspace), then, if `capture` is
// given, captured into a CUDA graph on that stream (the same or another, as torch.cuda.graph
// captures) and replayed: the outputs of the last run, for the tests to compare bit for bit.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "cuda_support.h"
#include "support.h"
#include "vpce/loss.h"

namespace vpce::test {

struct StepOutputs {
  std::vector<float> loss, grad;  // [N], [N, V] fp32
};

inline StepOutputs device_step(Communicator& comm, const Problem& p, cudaStream_t warm_up, cudaStream_t capture) {
  const int64_t n = p.tokens, vocab = p.vocab;
  DeviceBuffer logits(p.storage.data(), p.storage.size());
  DeviceBuffer y(p.targets.data(), p.targets.size() * sizeof(int64_t));
  DeviceBuffer loss(nullptr, n * sizeof(float)), lse(nullptr, n * sizeof(float));
  DeviceBuffer upstream(p.grad_loss.data(), n * sizeof(float));
  DeviceBuffer grad(nullptr, static_cast<std::size_t>(n * vocab) * sizeof(float));
  const TensorView x = TensorView::matrix(static_cast<char*>(logits.p) + p.offset_bytes, p.dtype, n, vocab, p.ld, kGpu);
  const TensorView yv = TensorView::contiguous(y.p, kInt64, {n}, kGpu);
  const TensorView lv = TensorView::contiguous(loss.p, kFloat32, {n}, kGpu);
  const TensorView ev = TensorView::contiguous(lse.p, kFloat32, {n}, kGpu);
  const TensorView gv = TensorView::contiguous(upstream.p, kFloat32, {n}, kGpu);
  const TensorView out = TensorView::contiguous(grad.p, kFloat32, {n, vocab}, kGpu);
  std::optional<Workspace> workspace(std::in_place);  // released before the caller's streams go
  auto step = [&](cudaStream_t stream) {
    LossOptions o;
    o.stream = stream;
    const Status f = forward(comm, x, yv, {0, vocab, vocab}, o, lv, ev, {}, &*workspace);
    EXPECT_TRUE(f.ok()) << f.to_string();
    const Status b = backward(x, yv, ev, gv, {0, vocab, vocab}, o, out);
    EXPECT_TRUE(b.ok()) << b.to_string();
  };
  step(warm_up);
  EXPECT_EQ(cudaStreamSynchronize(warm_up), cudaSuccess);
  if (capture != nullptr) {
    EXPECT_EQ(cudaMemsetAsync(loss.p, 0, loss.bytes, warm_up), cudaSuccess);  // (so a stale result cannot pass)
    EXPECT_EQ(cudaMemsetAsync(grad.p, 0, grad.bytes, warm_up), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(warm_up), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(capture, cudaStreamCaptureModeGlobal), cudaSuccess);
    step(capture);
    EXPECT_EQ(cudaStreamEndCapture(capture, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, capture), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(capture), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  const Status verdict = workspace->device_status();
  EXPECT_TRUE(verdict.ok()) << verdict.to_string();
  workspace.reset();
  return {loss.read<float>(static_cast<std::size_t>(n)), grad.read<float>(static_cast<std::size_t>(n * vocab))};
}

}  // namespace vpce::test
