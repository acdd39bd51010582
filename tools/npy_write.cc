// tools/npy_write.cc: npy::write_all, the all-or-nothing writer of a set of .npy files (see
// npy.h). POSIX calls rather than streams, so that every failure is seen where it happens
// (a full disk at write, fsync or close) with its errno; and a signal that ends the program
// while the temporaries exist (Ctrl-C, a job's SIGTERM, a file-size limit's SIGXFSZ)
// removes them first.
#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>

#include "npy.h"

namespace vpce::npy {
namespace {

Status system_error(const std::string& path, const std::string& what, int error, const char* outcome) {
  return {Code::kSystemError, path + ": " + what + ": " + std::strerror(error) + " (" + outcome + ")"};
}

constexpr char kNothingWritten[] = "no output written; the files already there are unchanged";

// ---- the temporaries a terminating signal removes -----------------------------------------

constexpr int kMaxTemporaries = 16;
constexpr std::array<int, 4> kSignals = {SIGINT, SIGTERM, SIGHUP, SIGXFSZ};
char g_temporaries[kMaxTemporaries][PATH_MAX];
volatile std::sig_atomic_t g_temporary_count = 0;
struct sigaction g_previous[kSignals.size()];

// Unlinks the temporaries (async-signal-safe), puts the signal's previous disposition back
// and raises it again, which ends the program as the signal would have (or runs the handler
// that was there), once this handler returns.
extern "C" void remove_temporaries_on_signal(int signal) {
  for (std::sig_atomic_t i = 0; i < g_temporary_count; ++i) ::unlink(g_temporaries[i]);
  g_temporary_count = 0;
  for (std::size_t k = 0; k < kSignals.size(); ++k) {
    if (kSignals[k] == signal) ::sigaction(signal, &g_previous[k], nullptr);
  }
  ::raise(signal);
}

// While it lives: the temporaries it is told of are removed if one of kSignals arrives.
// (One writer at a time: the program's writes are sequential.)
class TemporariesOnSignal {
 public:
  TemporariesOnSignal() {
    struct sigaction action {};
    action.sa_handler = remove_temporaries_on_signal;
    sigemptyset(&action.sa_mask);
    for (int signal : kSignals) sigaddset(&action.sa_mask, signal);  // one handler at a time
    for (std::size_t k = 0; k < kSignals.size(); ++k) ::sigaction(kSignals[k], &action, &g_previous[k]);
  }
  ~TemporariesOnSignal() {
    forget_all();
    for (std::size_t k = 0; k < kSignals.size(); ++k) ::sigaction(kSignals[k], &g_previous[k], nullptr);
  }
  TemporariesOnSignal(const TemporariesOnSignal&) = delete;
  TemporariesOnSignal& operator=(const TemporariesOnSignal&) = delete;

  // Before the file is created (a signal between creating and telling would leave it).
  void add(const std::string& path) {
    if (g_temporary_count >= kMaxTemporaries || path.size() >= PATH_MAX) return;
    std::memcpy(g_temporaries[g_temporary_count], path.c_str(), path.size() + 1);
    g_temporary_count = g_temporary_count + 1;  // (published after the name is complete)
  }
  // The last one added was not created after all.
  void drop_last() {
    if (g_temporary_count > 0) g_temporary_count = g_temporary_count - 1;
  }
  void forget_all() { g_temporary_count = 0; }
};

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

// Writes `file` to a new temporary in `dir`, named in `*temporary` once it exists (and in
// `on_signal` before).
Status write_temporary(const std::string& dir, const OutputFile& file, TemporariesOnSignal& on_signal,
                       std::string* temporary) {
  const std::string path = dir + "/" + file.name;
  int fd = -1;
  // O_EXCL and this process's id: never another writer's temporary, nor an existing file.
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    const std::string name =
        dir + "/." + file.name + "." + std::to_string(::getpid()) + "." + std::to_string(attempt) + ".partial";
    on_signal.add(name);
    fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) *temporary = name;
    if (fd < 0) on_signal.drop_last();
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

Status write_all(const std::string& dir, const std::vector<OutputFile>& files, const std::vector<std::string>& stale,
                 std::vector<std::string>* removed) {
  std::error_code error;
  const bool created = std::filesystem::create_directories(dir, error);
  if (error) return {Code::kSystemError, dir + ": cannot create the directory: " + error.message()};
  std::vector<std::string> temporaries;
  Status status;
  TemporariesOnSignal on_signal;
  for (const OutputFile& file : files) {
    std::string temporary;
    status = write_temporary(dir, file, on_signal, &temporary);
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
  on_signal.forget_all();
  if (!status.ok()) {
    if (created) std::filesystem::remove(dir, error);  // only if still empty
    return status;
  }
  // An earlier run's outputs that this one does not make (its extras) would pass for this
  // run's: removed.
  for (const std::string& name : stale) {
    if (::unlink((dir + "/" + name).c_str()) == 0 && removed != nullptr) removed->push_back(name);
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
