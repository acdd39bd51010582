// tools/npy.h: reading and writing NumPy's .npy files (format versions 1.0, 2.0, 3.0).
//
// Little-endian, C-order arrays of float16, float32, float64, int32 and int64, which is
// what the vpce command line exchanges. Anything else in a file (Fortran order, big-endian,
// other dtypes, a truncated or oversized body, a malformed header) is rejected with a
// message naming the file and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "vpce/status.h"

namespace vpce::npy {

enum class Dtype { kFloat16, kFloat32, kFloat64, kInt32, kInt64 };

// "<f2", "<f4", "<f8", "<i4", "<i8"
const char* descr(Dtype dtype);
int item_bytes(Dtype dtype);

struct Array {
  Dtype dtype = Dtype::kFloat32;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;  // numel() * item_bytes(dtype) bytes, C order

  int64_t numel() const;
  template <class T>
  const T* as() const {
    return reinterpret_cast<const T*>(data.data());
  }
};

// What a file's header says: dtype, shape and the number of data bytes.
struct Info {
  Dtype dtype = Dtype::kFloat32;
  std::vector<int64_t> shape;
  uint64_t data_bytes = 0;
};

// Parses a whole .npy file held in memory. `name` is used in messages.
Status parse(const std::byte* bytes, std::size_t size, const std::string& name, Array* out);
Status read(const std::string& path, Array* out);

// Reads only the header.
Status read_info(const std::string& path, Info* out);
// Reads columns [begin, end) of the last dimension and nothing else, as a rank of a
// tensor-parallel group reads its own vocabulary shard: shape [..., end - begin].
Status read_columns(const std::string& path, int64_t begin, int64_t end, Array* out);

// The header of a version 1.0 file (magic, version, length, padded dict), and the number
// of data bytes that follow it.
std::string header(Dtype dtype, const std::vector<int64_t>& shape);
uint64_t body_bytes(Dtype dtype, const std::vector<int64_t>& shape);
// The complete file image (header and data) of an array.
std::vector<std::byte> serialize(Dtype dtype, const std::vector<int64_t>& shape, const void* data);

// One array of a set that write_all writes.
struct OutputFile {
  std::string name;  // a file name inside the directory, such as "loss.npy"
  Dtype dtype = Dtype::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes every file into `dir` (created if missing), or none of them: each goes to a
// temporary file in `dir` with every write checked, is fsync'ed and closed (checked too),
// and only when all are complete are they renamed into place. On failure every temporary
// is removed, the files already in `dir` are left as they were, and the kSystemError
// message names the file and the system's error text. A signal that ends the program
// meanwhile (SIGINT, SIGTERM, SIGHUP, SIGXFSZ) removes the temporaries first. After
// success, the files named in `stale` (an earlier run's outputs this one does not make) are
// removed, and those that were there listed in *removed.
Status write_all(const std::string& dir, const std::vector<OutputFile>& files,
                 const std::vector<std::string>& stale = {}, std::vector<std::string>* removed = nullptr);

}  // namespace vpce::npy
