// tests/cuda/cuda_nccl_test.cc: the NCCL backend (vpce/nccl.h) on one GPU: a one-rank NCCL
// communicator's forward and backward, eager and captured in a CUDA graph, give the same
// bits as the device copy that stands in for the gather elsewhere. (More ranks need more
// GPUs: NCCL refuses two ranks on one device.) Without a device every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <memory>
#include <optional>

#include "cuda_support.h"
#include "support.h"
#include "vpce/loss.h"
#include "vpce/nccl.h"

namespace vpce::test {
namespace {

struct Outputs {
  std::vector<float> loss, grad;
};

// Forward and backward of `p` over `comm` on `stream`, eagerly or captured and replayed.
Outputs run_step(Communicator& comm, const Problem& p, cudaStream_t stream, bool captured) {
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
  LossOptions o;
  o.stream = stream;
  std::optional<Workspace> workspace(std::in_place);
  auto step = [&] {
    const Status f = forward(comm, x, yv, {0, vocab, vocab}, o, lv, ev, {}, &*workspace);
    EXPECT_TRUE(f.ok()) << f.to_string();
    const Status b = backward(x, yv, ev, gv, {0, vocab, vocab}, o, out);
    EXPECT_TRUE(b.ok()) << b.to_string();
  };
  step();  // (grows the workspace)
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  if (captured) {
    cudaMemset(loss.p, 0, loss.bytes);
    cudaMemset(grad.p, 0, grad.bytes);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    step();
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  const Status verdict = workspace->device_status();
  EXPECT_TRUE(verdict.ok()) << verdict.to_string();
  workspace.reset();
  return {loss.read<float>(static_cast<std::size_t>(n)), grad.read<float>(static_cast<std::size_t>(n * vocab))};
}

TEST(CudaNccl, OneRankMatchesTheDeviceCopyEagerAndCaptured) {
  REQUIRE_GPU();
  int device = 0;
  ncclComm_t nccl = nullptr;
  ASSERT_EQ(ncclCommInitAll(&nccl, 1, &device), ncclSuccess);
  std::unique_ptr<NcclCommunicator> comm;
  ASSERT_TRUE(NcclCommunicator::create(nccl, &comm).ok());
  EXPECT_EQ(comm->size(), 1);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const Problem p = random_problem(96, 3000, kBFloat16, 7);
  DeviceLoopback copy;
  const Outputs expected = run_step(copy, p, stream, false);
  for (bool captured : {false, true}) {
    SCOPED_TRACE(captured ? "captured" : "eager");
    const Outputs got = run_step(*comm, p, stream, captured);
    EXPECT_EQ(got.loss, expected.loss);
    EXPECT_EQ(got.grad, expected.grad);
  }
  cudaStreamDestroy(stream);
  ncclCommDestroy(nccl);
}

}  // namespace
}  // namespace vpce::test
