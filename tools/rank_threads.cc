// tools/rank_threads.cc: see rank_threads.h.
#include "rank_threads.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

namespace vpce::tools {

Status run_on_threads(ThreadGroup& group, const std::function<Status(Communicator&)>& fn, const char* flag,
                      std::vector<Status>* results) {
  const int ranks = group.size();
  results->assign(static_cast<std::size_t>(ranks), Status());
  enum class Gate { kClosed, kRun, kCancel };
  Gate gate = Gate::kClosed;
  std::mutex mutex;
  std::condition_variable opened;
  auto open = [&](Gate to) {
    const std::lock_guard<std::mutex> lock(mutex);
    gate = to;
    opened.notify_all();
  };
  std::vector<std::thread> threads;
  Status started;
  try {
    threads.reserve(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        {
          std::unique_lock<std::mutex> lock(mutex);
          opened.wait(lock, [&] { return gate != Gate::kClosed; });
          if (gate == Gate::kCancel) return;
        }
        Status& result = (*results)[static_cast<std::size_t>(r)];
        try {
          result = fn(group.communicator(r));
        } catch (const std::exception& e) {
          result = {Code::kInternalError, std::string("rank function threw: ") + e.what()};
        }
      });
    }
  } catch (const std::exception& e) {
    started = {Code::kSystemError, std::string(flag) + ": expected " + std::to_string(ranks) +
                                       " rank threads, could start only " + std::to_string(threads.size()) + ": " +
                                       e.what()};
  }
  open(started.ok() ? Gate::kRun : Gate::kCancel);
  for (std::thread& t : threads) t.join();
  return started;
}

}  // namespace vpce::tools
