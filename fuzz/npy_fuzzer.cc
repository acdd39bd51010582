// fuzz/npy_fuzzer.cc: any bytes given to the .npy parser either parse into an array whose
// data size matches its shape and dtype and which survives a write-and-read round trip,
// or are rejected with a message that names the file. Never a crash or a sanitizer report.
#include <cstdint>
#include <cstring>
#include <string>

#include "npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  vpce::npy::Array array;
  const vpce::Status status = vpce::npy::parse(reinterpret_cast<const std::byte*>(data), size, "fuzz.npy", &array);
  if (!status.ok()) {
    if (status.message().rfind("fuzz.npy: ", 0) != 0) __builtin_trap();  // every rejection names the file
    return 0;
  }
  const auto expected =
      static_cast<uint64_t>(array.numel()) * static_cast<uint64_t>(vpce::npy::item_bytes(array.dtype));
  if (array.data.size() != expected) __builtin_trap();
  if (array.data.size() > (size_t{1} << 24)) return 0;  // parse only: keep the round trip cheap
  const std::vector<std::byte> image = vpce::npy::serialize(array.dtype, array.shape, array.data.data());
  vpce::npy::Array again;
  if (!vpce::npy::parse(image.data(), image.size(), "again.npy", &again).ok()) __builtin_trap();
  if (again.shape != array.shape || again.dtype != array.dtype || again.data != array.data) __builtin_trap();
  return 0;
}
