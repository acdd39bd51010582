// tools/npy_write.cc: npy::write_all, the all-or-nothing writer of a set of .npy files (see
// npy.h). POSIX calls rather than streams, so that every failure is seen where it happens
// (a full disk at write, fsync or close) with its errno.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "npy.h"

namespace vpce::npy {
namespace {

Status system_error(const std::string& path, const std::string& what, int error, const char* outcome) {
  return {Code::kSystemError, path + ": " + what + ": " + std::strerror(error) + " (" + outcome + ")"};
}

constexpr char kNothingWritten[] = "no output written; the files already there are unchanged";

// Writes all `bytes`; false with errno set on failure.
bool write_fully(int fd, const void* data, uint64_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, static_cast<std::size_t>(std::min<uint64_t>(bytes, uint64_t{1} << 30)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
  }
  return true;
}

// Writes `file` to a new temporary in `dir`, named in `*temporary` once it exists.
Status write_temporary(const std::string& dir, const OutputFile& file, std::string* temporary) {
  const std::string path = dir + "/" + file.name;
  int fd = -1;
  // O_EXCL and this process's id: never another writer's temporary, nor an existing file.
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    const std::string name = dir + "/." + file.name + "." + std::to_string(::getpid()) + "." +
                             std::to_string(attempt) + ".partial";
    fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) *temporary = name;
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return system_error(path, "cannot create a temporary file in the directory", errno, kNothingWritten);
  const std::string head = header(file.dtype, file.shape);
  bool ok = write_fully(fd, head.data(), head.size()) &&
            write_fully(fd, file.data, body_bytes(file.dtype, file.shape)) && ::fsync(fd) == 0;
  int error = ok ? 0 : errno;
  if (::close(fd) != 0 && ok) {
    ok = false;
    error = errno;
  }
  return ok ? Status() : system_error(path, "cannot write", error, kNothingWritten);
}

}  // namespace

Status write_all(const std::string& dir, const std::vector<OutputFile>& files) {
  std::error_code error;
  const bool created = std::filesystem::create_directories(dir, error);
  if (error) return {Code::kSystemError, dir + ": cannot create the directory: " + error.message()};
  std::vector<std::string> temporaries;
  Status status;
  for (const OutputFile& file : files) {
    std::string temporary;
    status = write_temporary(dir, file, &temporary);
    if (!temporary.empty()) temporaries.push_back(temporary);
    if (!status.ok()) break;
  }
  // Every file is complete on disk: rename them all into place. (A rename within one
  // directory fails only if the directory itself cannot be written; then the files
  // renamed before it are already the new ones.)
  std::size_t renamed = 0;
  for (; status.ok() && renamed < temporaries.size(); ++renamed) {
    const std::string path = dir + "/" + files[renamed].name;
    if (std::rename(temporaries[renamed].c_str(), path.c_str()) != 0) {
      status = system_error(path, "cannot rename the written file into place", errno,
                            "the outputs listed before it were replaced, the others are unchanged");
      break;
    }
  }
  for (std::size_t i = renamed; i < temporaries.size(); ++i) ::unlink(temporaries[i].c_str());
  if (!status.ok()) {
    if (created) std::filesystem::remove(dir, error);  // only if still empty
    return status;
  }
  // The renames themselves reach the disk with the directory (best effort: some file
  // systems cannot fsync a directory).
  if (const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  return {};
}

}  // namespace vpce::npy
