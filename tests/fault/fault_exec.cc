// tests/fault/fault_exec.cc: runs a program under injected resource faults, for the fault
// tests:
//   vpce_fault_exec [--fsize BYTES] [--fsize-signal BYTES] [--as BYTES] [--alarm SECONDS] -- PROGRAM ARGS...
// --fsize sets RLIMIT_FSIZE, a full disk as far as the program can tell (write() fails with
// EFBIG: SIGXFSZ is ignored here, and an ignored signal stays ignored across exec);
// --fsize-signal sets it with SIGXFSZ left to end the program, a signal that arrives in
// the middle of a write (as Ctrl-C or a job's SIGTERM may);
// --as sets RLIMIT_AS, so that allocations and thread stacks fail; --alarm kills the
// program with SIGALRM after SECONDS, so that a hang becomes a failure.
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  int i = 1;
  for (; i + 1 < argc && std::strcmp(argv[i], "--") != 0; i += 2) {
    const unsigned long long value = std::strtoull(argv[i + 1], nullptr, 10);
    const rlimit limit{value, value};
    if (std::strcmp(argv[i], "--fsize") == 0 || std::strcmp(argv[i], "--fsize-signal") == 0) {
      std::signal(SIGXFSZ, std::strcmp(argv[i], "--fsize") == 0 ? SIG_IGN : SIG_DFL);
      if (setrlimit(RLIMIT_FSIZE, &limit) != 0) return std::perror("setrlimit(RLIMIT_FSIZE)"), 125;
    } else if (std::strcmp(argv[i], "--as") == 0) {
      if (setrlimit(RLIMIT_AS, &limit) != 0) return std::perror("setrlimit(RLIMIT_AS)"), 125;
    } else if (std::strcmp(argv[i], "--alarm") == 0) {
      alarm(static_cast<unsigned>(value));
    } else {
      std::fprintf(stderr, "vpce_fault_exec: unknown option %s\n", argv[i]);
      return 125;
    }
  }
  if (i + 1 >= argc) {
    std::fprintf(stderr, "usage: vpce_fault_exec [--fsize B] [--as B] [--alarm S] -- PROGRAM ARGS...\n");
    return 125;
  }
  execvp(argv[i + 1], argv + i + 1);
  std::perror(argv[i + 1]);
  return 127;
}
