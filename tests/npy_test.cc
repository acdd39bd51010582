// tests/npy_test.cc: the .npy reader and writer, against file images written by hand from
// the format's specification (not by vpce's own writer), and malformed files.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "npy.h"

namespace vpce::npy {
namespace {

// A version 1.0 file image: magic, version, little-endian header length, header, data.
std::vector<std::byte> image(const std::string& header, const void* data, std::size_t bytes, int major = 1) {
  std::string text = "\x93NUMPY";
  text += static_cast<char>(major);
  text += '\0';
  if (major == 1) {
    text += static_cast<char>(header.size() & 0xff);
    text += static_cast<char>(header.size() >> 8);
  } else {
    for (int b = 0; b < 4; ++b) text += static_cast<char>((header.size() >> (8 * b)) & 0xff);
  }
  text += header;
  std::vector<std::byte> out(text.size() + bytes);
  std::memcpy(out.data(), text.data(), text.size());
  if (bytes > 0) std::memcpy(out.data() + text.size(), data, bytes);
  return out;
}

Status parse_image(const std::vector<std::byte>& bytes, Array* out) {
  return parse(bytes.data(), bytes.size(), "x.npy", out);
}

TEST(Npy, ReadsWhatNumpyWrites) {
  const float values[6] = {1, 2, 3, 4, 5, 6.5f};
  // Exactly numpy.save's header for np.zeros((2, 3), np.float32), padded to 64 bytes.
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  Array a;
  ASSERT_TRUE(parse_image(image(header, values, sizeof(values)), &a).ok());
  EXPECT_EQ(a.dtype, Dtype::kFloat32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.as<float>()[5], 6.5f);
}

TEST(Npy, ReadsVersionTwoOtherKeyOrderAndOneDimension) {
  const int64_t values[3] = {7, -1, 1LL << 40};
  Array a;
  ASSERT_TRUE(
      parse_image(image("{\"shape\": (3,), \"fortran_order\": False, \"descr\": \"<i8\"}\n", values, 24, 2), &a).ok());
  EXPECT_EQ(a.dtype, Dtype::kInt64);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(a.as<int64_t>()[2], 1LL << 40);
}

TEST(Npy, ReadsZeroDimensionalAndEmptyArrays) {
  const int32_t one = 42;
  Array a;
  ASSERT_TRUE(parse_image(image("{'descr': '<i4', 'fortran_order': False, 'shape': (), }\n", &one, 4), &a).ok());
  EXPECT_TRUE(a.shape.empty());
  EXPECT_EQ(a.numel(), 1);
  ASSERT_TRUE(parse_image(image("{'descr': '<f2', 'fortran_order': False, 'shape': (0, 5), }\n", nullptr, 0), &a).ok());
  EXPECT_EQ(a.numel(), 0);
}

TEST(Npy, WriterOutputIsAlignedAndReadsBack) {
  const double values[4] = {0.5, -2, 1e300, 3};
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{4}, std::vector<int64_t>{2, 2}, std::vector<int64_t>{1, 4, 1}}) {
    const std::vector<std::byte> bytes = serialize(Dtype::kFloat64, shape, values);
    const std::size_t header_len = static_cast<std::size_t>(bytes[8]) | static_cast<std::size_t>(bytes[9]) << 8;
    EXPECT_EQ((10 + header_len) % 64, 0u);
    EXPECT_EQ(static_cast<char>(bytes[10 + header_len - 1]), '\n');
    Array a;
    ASSERT_TRUE(parse_image(bytes, &a).ok());
    EXPECT_EQ(a.shape, shape);
    EXPECT_EQ(std::memcmp(a.data.data(), values, sizeof(values)), 0);
  }
  const std::string expected_start = "\x93NUMPY\x01";
  const auto bytes = serialize(Dtype::kInt32, {3}, values);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), 7), expected_start);
  EXPECT_NE(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()).find("'shape': (3,)"),
            std::string::npos);
}

void expect_rejected(const std::vector<std::byte>& bytes, const char* fragment) {
  Array a;
  const Status s = parse_image(bytes, &a);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("x.npy"), std::string::npos) << s.message();
}

TEST(Npy, RejectsMalformedFiles) {
  const float four[8] = {};  // room for the oversized case
  const std::string good_start = "{'descr': '<f4', 'fortran_order': False, 'shape': ";
  expect_rejected({std::byte{0x93}, std::byte{'N'}}, "magic");
  expect_rejected(image(good_start + "(4,), }", four, 16, 4), "format version");
  expect_rejected(image("{'descr': '<f4', 'fortran_order': True, 'shape': (4,), }", four, 16), "fortran_order");
  expect_rejected(image("{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", four, 16), "'>f4'");
  expect_rejected(image("{'descr': '|u1', 'fortran_order': False, 'shape': (4,), }", four, 16), "dtype");
  expect_rejected(image(good_start + "(4,), }", four, 12), "expected 16 bytes");
  expect_rejected(image(good_start + "(4,), }", four, 16 - 4 + 8), "expected 16 bytes");
  expect_rejected(image(good_start + "(4 4), }", four, 16), "shape");
  expect_rejected(image(good_start + "(-4,), }", four, 16), "shape");
  // (4) is Python's 4, not a tuple (numpy.load refuses it); (4, 1) and (4,) stay accepted.
  expect_rejected(image(good_start + "(4), }", four, 16), "shape: expected a tuple, (4,) for one dimension, got (4)");
  expect_rejected(image(good_start + "( 4 ), }", four, 16), "shape: expected a tuple");
  // 04 is no Python 3 literal (numpy.load refuses it; it reads 00 as 0); a structured dtype is
  // named as such.
  Array zero_rows;
  ASSERT_TRUE(parse_image(image(good_start + "(00, 4), }", four, 0), &zero_rows).ok());
  EXPECT_EQ(zero_rows.shape, (std::vector<int64_t>{0, 4}));
  expect_rejected(image(good_start + "(04,), }", four, 16),
                  "shape: expected decimal integers without a leading "
                  "zero, got 04");
  expect_rejected(image("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }", four, 16),
                  "dtype: expected a simple dtype's string for 'descr'");
  expect_rejected(image(good_start + "(99999999999999999999,), }", four, 16),
                  "shape: expected dimensions of at most 2^63 - 1, got 99999999999999999999, which overflows int64");
  expect_rejected(image(good_start + "(4294967296, 4294967296, 4294967296), }", four, 16), "overflows");
  expect_rejected(image("{'descr': '<f4', 'shape': (4,), }", four, 16), "expected the keys");
  expect_rejected(image(good_start + "(4,), 'extra': 1}", four, 16), "unexpected key 'extra'");
  expect_rejected(image(good_start + "(4,), } trailing", four, 16), "after the dict");
  std::vector<std::byte> truncated = image(good_start + "(4,), }", four, 16);
  truncated.resize(20);
  expect_rejected(truncated, "truncated header");
}

TEST(Npy, MissingFileIsAnError) {
  Array a;
  const Status s = read("/nonexistent/dir/file.npy", &a);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent/dir/file.npy"), std::string::npos);
}

void write_image(const std::string& path, const std::vector<std::byte>& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
}

TEST(Npy, ReadsOnlyTheRequestedColumns) {
  // A [2, 3, 5] float32 array written by hand; element (a, b, c) = 100a + 10b + c.
  float values[30];
  for (int i = 0; i < 30; ++i) values[i] = static_cast<float>(100 * (i / 15) + 10 * (i / 5 % 3) + i % 5);
  const std::string path = testing::TempDir() + "npy_columns.npy";
  write_image(path, image("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 5), }\n", values, sizeof(values)));
  Info info;
  ASSERT_TRUE(read_info(path, &info).ok());
  EXPECT_EQ(info.shape, (std::vector<int64_t>{2, 3, 5}));
  EXPECT_EQ(info.data_bytes, sizeof(values));
  Array a;
  ASSERT_TRUE(read_columns(path, 1, 4, &a).ok());
  ASSERT_EQ(a.shape, (std::vector<int64_t>{2, 3, 3}));
  for (int row = 0; row < 6; ++row) {
    for (int c = 0; c < 3; ++c) {
      EXPECT_EQ(a.as<float>()[row * 3 + c], static_cast<float>(100 * (row / 3) + 10 * (row % 3) + c + 1));
    }
  }
  ASSERT_TRUE(read_columns(path, 5, 5, &a).ok());  // an empty shard
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3, 0}));
  EXPECT_TRUE(a.data.empty());
  const Status bad_range = read_columns(path, 3, 6, &a);
  EXPECT_EQ(bad_range.code(), Code::kInvalidArgument);
  EXPECT_NE(bad_range.message().find("got [3, 6)"), std::string::npos) << bad_range.to_string();
  // A truncated body is caught from the header and the file size, without reading it all.
  std::vector<std::byte> cut = image("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 5), }\n", values, 100);
  write_image(path, cut);
  const Status truncated = read_columns(path, 0, 1, &a);
  EXPECT_FALSE(truncated.ok());
  EXPECT_NE(truncated.message().find("expected 120 bytes"), std::string::npos) << truncated.to_string();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace vpce::npy
