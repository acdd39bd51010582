// tests/cuda/cuda_nccl_test.cc: the NCCL backend (vpce/nccl.h) on one GPU: a one-rank NCCL
// communicator's forward and backward, eager and captured in a CUDA graph, give the same
// bits as the device copy that stands in for the gather elsewhere. (More ranks need more
// GPUs: NCCL refuses two ranks on one device.) Without a device every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <memory>

#include "cuda_step.h"
#include "cuda_support.h"
#include "support.h"
#include "vpce/nccl.h"

namespace vpce::test {
namespace {

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
  const StepOutputs expected = device_step(copy, p, stream, nullptr);
  for (bool captured : {false, true}) {
    SCOPED_TRACE(captured ? "captured" : "eager");
    const StepOutputs got = device_step(*comm, p, stream, captured ? stream : nullptr);
    EXPECT_EQ(got.loss, expected.loss);
    EXPECT_EQ(got.grad, expected.grad);
  }
  cudaStreamDestroy(stream);
  ncclCommDestroy(nccl);
}

}  // namespace
}  // namespace vpce::test
