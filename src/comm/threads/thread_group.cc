// comm/threads/thread_group.cc: the in-process backend (see vpce/threads.h).
//
// all_gather is two barrier phases over shared state: every rank posts (pointer, size) and
// waits for all; every rank then checks that the sizes agree and copies every rank's bytes
// into its own buffer; a second barrier keeps each send buffer alive until all have copied.
// A barrier that times out breaks the group, and a broken group fails every call at once.
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "../../common/text.h"
#include "../gather_size_hint.h"
#include "vpce/threads.h"

namespace vpce {

struct ThreadGroup::Shared {
  struct Slot {
    const void* data = nullptr;
    std::size_t bytes = 0;
    const void* recv = nullptr;
    std::string fault;  // what is wrong with this rank's buffers; empty when nothing is
  };

  Shared(int n, std::chrono::milliseconds t) : size(n), timeout(t), slots(static_cast<size_t>(n)) {}

  // Waits until every rank has arrived in this phase, or (when `timed`) the timeout passes
  // or the group breaks; every rank waiting when it breaks returns kTimeout. Called with
  // `lock` held.
  Status arrive_and_wait(std::unique_lock<std::mutex>& lock, const char* phase, bool timed) {
    if (broken) return broken_status();
    const uint64_t my_generation = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      changed.notify_all();
      return {};
    }
    if (!timed) {
      changed.wait(lock, [&] { return generation != my_generation; });
      return {};
    }
    const bool done = changed.wait_for(lock, timeout, [&] { return broken || generation != my_generation; });
    if (generation != my_generation) return {};
    if (!done) {
      broken = true;
      broken_reason = "expected every rank at all_gather (" + std::string(phase) + ") within " +
                      std::to_string(timeout.count()) + " ms, got a rank that did not arrive";
      changed.notify_all();
    }
    return {Code::kTimeout, "threads backend: " + broken_reason};
  }

  Status broken_status() const {
    return {Code::kInvalidUsage,
            "threads backend: expected a working group, got one broken by an earlier failure (" + broken_reason + ")"};
  }

  const int size;
  const std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable changed;
  int arrived = 0;
  uint64_t generation = 0;
  bool broken = false;
  std::string broken_reason;
  std::vector<Slot> slots;
};

class ThreadGroup::RankCommunicator final : public Communicator {
 public:
  RankCommunicator(Shared* shared, int rank) : shared_(shared), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return shared_->size; }
  const char* name() const override { return "threads"; }

  Status all_gather(const void* send, void* recv, std::size_t bytes) override {
    // A rank's bad buffers are posted with its slot, so that every rank fails alike (rather
    // than the others waiting for it until the timeout).
    std::string fault = buffer_fault(send, recv, bytes);
    std::unique_lock<std::mutex> lock(shared_->mutex);
    shared_->slots[static_cast<size_t>(rank_)] = Shared::Slot{send, bytes, recv, std::move(fault)};
    if (Status s = shared_->arrive_and_wait(lock, "posting", true); !s.ok()) return s;
    // No rank writes its slot again before every rank has passed the second phase, so the
    // slots can be read without the lock until then.
    const std::vector<Shared::Slot>& slots = shared_->slots;
    lock.unlock();

    // Every rank reads the slots in the same order, so all return the same message.
    Status result;
    for (int r = 0; r < shared_->size && result.ok(); ++r) {
      const std::string& f = slots[static_cast<size_t>(r)].fault;
      if (f.empty()) continue;
      result = {r == rank_ ? Code::kInvalidArgument : Code::kRemoteError,
                "all_gather: rank " + std::to_string(r) + " of " + std::to_string(shared_->size) + ": " + f};
    }
    if (result.ok()) result = shared_buffers(slots);
    for (int r = 1; r < shared_->size && result.ok(); ++r) {
      if (slots[static_cast<size_t>(r)].bytes != slots[0].bytes) {
        result = {Code::kInvalidUsage, "threads backend: ranks disagree on the all_gather size: expected rank 0's " +
                                           std::to_string(slots[0].bytes) + " bytes from every rank, got " +
                                           std::to_string(slots[static_cast<size_t>(r)].bytes) + " from rank " +
                                           std::to_string(r) + detail::kGatherSizeHint};
      }
    }
    if (result.ok()) {
      auto* out = static_cast<char*>(recv);
      for (int r = 0; r < shared_->size; ++r) {
        if (bytes > 0) std::memcpy(out + static_cast<size_t>(r) * bytes, slots[static_cast<size_t>(r)].data, bytes);
      }
    }
    // Every rank is here and only copies memory: wait without a timeout, so that no send
    // buffer is released while another rank still reads it.
    lock.lock();
    if (Status s = shared_->arrive_and_wait(lock, "copying", false); !s.ok()) return s;
    return result;
  }

 private:
  // A rank's recv buffer that another rank's send or recv buffer overlaps (its bytes would be
  // overwritten while another rank reads or writes them): kInvalidUsage, the same on every
  // rank (each rank's own buffers were checked by buffer_fault). One sweep over the buffers
  // sorted by address, O(R log R): each overlaps an earlier one exactly where it starts before
  // the furthest end so far (of any buffer for a recv, of a recv for a send).
  Status shared_buffers(const std::vector<Shared::Slot>& slots) const {
    struct Span {
      uintptr_t begin, end;
      int rank;
      bool recv;
    };
    const auto n = static_cast<std::size_t>(shared_->size);
    std::vector<Span> spans;
    spans.reserve(2 * n);
    for (std::size_t r = 0; r < n; ++r) {
      const Shared::Slot& slot = slots[r];
      if (slot.bytes == 0) continue;
      const auto send = reinterpret_cast<uintptr_t>(slot.data), recv = reinterpret_cast<uintptr_t>(slot.recv);
      spans.push_back({send, send + slot.bytes, static_cast<int>(r), false});
      spans.push_back({recv, recv + slot.bytes * n, static_cast<int>(r), true});
    }
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.rank != b.rank ? a.rank < b.rank : a.recv < b.recv;
    });
    const Span* furthest = nullptr;       // of every buffer so far
    const Span* furthest_recv = nullptr;  // of the recv buffers so far
    for (const Span& s : spans) {
      const Span* hit = s.recv ? furthest : furthest_recv;
      if (hit != nullptr && s.begin < hit->end && hit->rank != s.rank) {
        // Named as the recv's rank and the other's buffer (two recvs: the lower rank first).
        const Span& recv = !s.recv || (hit->recv && hit->rank < s.rank) ? *hit : s;
        const Span& other = &recv == hit ? s : *hit;
        return {Code::kInvalidUsage,
                "all_gather: expected each rank's recv buffer to share no byte with another "
                "rank's buffers, got rank " +
                    std::to_string(recv.rank) + "'s recv overlapping rank " + std::to_string(other.rank) + "'s " +
                    (other.recv ? "recv" : "send")};
      }
      if (furthest == nullptr || s.end > furthest->end) furthest = &s;
      if (s.recv && (furthest_recv == nullptr || s.end > furthest_recv->end)) furthest_recv = &s;
    }
    return {};
  }

  // Null buffers, or a send buffer that overlaps the receive buffer (which every rank's bytes
  // are copied into while this rank's are still being read): the text of the fault, or "".
  std::string buffer_fault(const void* send, const void* recv, std::size_t bytes) const {
    if (bytes == 0) return {};
    if (send == nullptr || recv == nullptr) {
      return "expected non-null send and recv buffers for " + std::to_string(bytes) + " bytes, got null";
    }
    const auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
    uintptr_t recv_bytes = 0, send_end = 0, recv_end = 0;
    if (__builtin_mul_overflow(bytes, static_cast<uintptr_t>(shared_->size), &recv_bytes) ||
        __builtin_add_overflow(s, bytes, &send_end) || __builtin_add_overflow(r, recv_bytes, &recv_end)) {
      return "expected send and recv buffers inside the address space, got " + std::to_string(bytes) +
             " bytes per rank that carry them past its end";
    }
    if (s < recv_end && r < send_end) {
      return "expected send and recv buffers that do not overlap, got send " + detail::hex_address(send) + " (" +
             std::to_string(bytes) + " bytes) and recv " + detail::hex_address(recv) + " (" +
             std::to_string(recv_bytes) + " bytes)";
    }
    return {};
  }

  Shared* shared_;
  int rank_;
};

ThreadGroup::ThreadGroup(int num_ranks, std::chrono::milliseconds timeout)
    : shared_(std::make_unique<Shared>(num_ranks, timeout)) {
  for (int r = 0; r < num_ranks; ++r) {
    ranks_.push_back(std::make_unique<RankCommunicator>(shared_.get(), r));
  }
}

ThreadGroup::~ThreadGroup() = default;

Status ThreadGroup::create(int num_ranks, std::unique_ptr<ThreadGroup>* group, std::chrono::milliseconds timeout) {
  if (group == nullptr) {
    return {Code::kInvalidArgument, "group: expected a non-null pointer, got null"};
  }
  if (num_ranks < 1 || num_ranks > 4096) {
    return {Code::kInvalidArgument, "num_ranks: expected a value in [1, 4096], got " + std::to_string(num_ranks)};
  }
  if (timeout.count() <= 0) {
    return {Code::kInvalidArgument, "timeout: expected > 0 ms, got " + std::to_string(timeout.count()) + " ms"};
  }
  try {
    group->reset(new ThreadGroup(num_ranks, timeout));
  } catch (const std::bad_alloc&) {
    return {Code::kSystemError, "ThreadGroup::create: out of memory"};
  }
  return {};
}

int ThreadGroup::size() const { return shared_->size; }

namespace {

// What communicator() returns for a rank outside the group: every call fails by name.
class InvalidCommunicator final : public Communicator {
 public:
  int rank() const override { return -1; }
  int size() const override { return 0; }
  const char* name() const override { return "invalid"; }
  Status all_gather(const void*, void*, std::size_t) override {
    return {Code::kInvalidArgument,
            "communicator: expected one from ThreadGroup::communicator(r) with r in the group, got "
            "the one returned for a rank outside it"};
  }
};

}  // namespace

Communicator& ThreadGroup::communicator(int rank) {
  static InvalidCommunicator invalid;
  if (rank < 0 || rank >= size()) return invalid;
  return *ranks_[static_cast<size_t>(rank)];
}

std::vector<Status> ThreadGroup::run(const std::function<Status(Communicator&)>& fn) {
  const auto n = static_cast<size_t>(size());
  std::vector<Status> results(n);
  // Every rank's thread waits at this gate until all are started, so a thread that cannot
  // be started cancels the run before any rank reaches a collective (which would otherwise
  // make the started ranks wait out the group's timeout).
  enum class Gate { kClosed, kOpen, kCancelled };
  Gate gate = Gate::kClosed;
  std::mutex mutex;
  std::condition_variable opened;
  std::vector<std::thread> threads;
  std::string failure;
  try {
    threads.reserve(n);
    for (size_t r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        {
          std::unique_lock<std::mutex> lock(mutex);
          opened.wait(lock, [&] { return gate != Gate::kClosed; });
          if (gate == Gate::kCancelled) return;
        }
        try {
          results[r] = fn(*ranks_[r]);
        } catch (const std::exception& e) {
          results[r] = Status(Code::kInternalError, std::string("rank function threw: ") + e.what());
        } catch (...) {
          results[r] = Status(Code::kInternalError, "rank function threw a non-standard exception");
        }
      });
    }
  } catch (const std::exception& e) {  // std::system_error, or bad_alloc for a thread's state
    failure = e.what();
  }
  {
    const std::lock_guard<std::mutex> lock(mutex);
    gate = failure.empty() ? Gate::kOpen : Gate::kCancelled;
  }
  opened.notify_all();
  for (std::thread& t : threads) t.join();
  if (!failure.empty()) {
    return std::vector<Status>(
        n, Status(Code::kSystemError, std::string(kCouldNotStart) + "expected " + std::to_string(n) +
                                          " rank threads, could start only " + std::to_string(threads.size()) + ": " +
                                          failure));
  }
  return results;
}

}  // namespace vpce
