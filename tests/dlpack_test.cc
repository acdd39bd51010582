// tests/dlpack_test.cc: vpce::TensorView converts to and from DLPack's DLTensor (the real
// <dlpack/dlpack.h>) without loss, and a converted tensor runs through vpce.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "vpce/dlpack.h"
#include "vpce/vpce.h"

namespace vpce {
namespace {

TEST(DLPack, CodesAreDLPacksOwn) {
  EXPECT_EQ(static_cast<int>(DeviceType::kCPU), kDLCPU);
  EXPECT_EQ(static_cast<int>(DeviceType::kCUDA), kDLCUDA);
  EXPECT_EQ(static_cast<int>(TypeCode::kFloat), kDLFloat);
  EXPECT_EQ(static_cast<int>(TypeCode::kBfloat), kDLBfloat);
  EXPECT_EQ(static_cast<int>(TypeCode::kInt), kDLInt);
}

TEST(DLPack, NullStridesBecomeRowMajorAndRoundTrip) {
  float data[24] = {};
  int64_t shape[3] = {2, 3, 4};
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = 3;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 8;
  TensorView view;
  ASSERT_TRUE(from_dlpack(t, &view).ok());
  EXPECT_EQ(view.strides[0], 12);
  EXPECT_EQ(view.strides[1], 4);
  EXPECT_EQ(view.strides[2], 1);
  EXPECT_EQ(view.dtype, kFloat32);
  EXPECT_EQ(view.byte_offset, 8u);
  const DLTensor back = to_dlpack(view);
  EXPECT_EQ(back.data, t.data);
  EXPECT_EQ(back.ndim, 3);
  EXPECT_EQ(back.shape[2], 4);
  EXPECT_EQ(back.strides[0], 12);
  EXPECT_EQ(back.byte_offset, 8u);
}

// A shape whose size overflows int64, with null strides (compact) or through
// TensorView::contiguous: strides computed without overflow (UBSan checks it in
// scripts/sanitize.sh), and the forward refuses the logits by name.
TEST(DLPack, ShapesWhoseSizeOverflowsInt64AreRefused) {
  int64_t shape[4] = {8, int64_t{1} << 40, int64_t{1} << 40, 4};  // strides[0] would be 2^82
  float data[4] = {};
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = 4;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  TensorView from_pack;
  ASSERT_TRUE(from_dlpack(t, &from_pack).ok());
  EXPECT_EQ(from_pack.strides[0], std::numeric_limits<int64_t>::max());
  const TensorView direct = TensorView::contiguous(data, kFloat32, {8, int64_t{1} << 40, int64_t{1} << 40, 4});
  EXPECT_EQ(direct.strides[0], std::numeric_limits<int64_t>::max());
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  int64_t targets[1] = {0};
  float loss[1], lse[1];
  for (const TensorView& x : {from_pack, direct}) {
    const Status s = forward(group->communicator(0), x, TensorView::contiguous(targets, kInt64, {1}), {0, 4, 4}, {},
                             TensorView::contiguous(loss, kFloat32, {1}), TensorView::contiguous(lse, kFloat32, {1}));
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("logits"), std::string::npos) << s.to_string();
  }
}

TEST(DLPack, RejectsMalformedTensors) {
  DLTensor t{};
  t.ndim = 9;
  TensorView view;
  EXPECT_EQ(from_dlpack(t, &view).code(), Code::kInvalidArgument);
  t.ndim = 2;
  t.shape = nullptr;
  const Status s = from_dlpack(t, &view);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("tensor.shape"), std::string::npos);
}

TEST(DLPack, ConvertedTensorsRunThroughVpce) {
  float logits[2][3] = {{0, 0, 0}, {1, 2, 3}};
  int32_t targets[2] = {1, 2};
  float loss[2], lse[2];
  int64_t logits_shape[2] = {2, 3}, token_shape[1] = {2};
  DLTensor x{logits, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, logits_shape, nullptr, 0};
  DLTensor y{targets, {kDLCPU, 0}, 1, {kDLInt, 32, 1}, token_shape, nullptr, 0};
  DLTensor l{loss, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, token_shape, nullptr, 0};
  DLTensor e{lse, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, token_shape, nullptr, 0};
  TensorView xv, yv, lv, ev;
  ASSERT_TRUE(from_dlpack(x, &xv).ok() && from_dlpack(y, &yv).ok() && from_dlpack(l, &lv).ok() &&
              from_dlpack(e, &ev).ok());
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  ASSERT_TRUE(forward(group->communicator(0), xv, yv, VocabShard{0, 3, 3}, LossOptions{}, lv, ev).ok());
  EXPECT_NEAR(loss[0], std::log(3.0), 1e-6);
  EXPECT_NEAR(loss[1], std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0, 1e-6);
}

}  // namespace
}  // namespace vpce
