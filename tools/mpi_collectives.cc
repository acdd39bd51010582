// tools/mpi_collectives.cc: see mpi_collectives.h.
#include "mpi_collectives.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace vpce::tools {
namespace {

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", value);
  return text;
}

// Every flag of `vpce run`, in a fixed order, as text ("" when not given).
std::vector<std::pair<const char*, std::string>> flag_values(const RunConfig& c) {
  std::string splits;
  for (int64_t s : c.vocab_splits) splits += (splits.empty() ? "" : ",") + std::to_string(s);
  const LossOptions& o = c.loss;
  return {{"--logits", c.logits_path},
          {"--targets", c.targets_path},
          {"--grad-output", c.grad_output_path},
          {"--weights", c.weights_path},
          {"--out", c.out_dir},
          {"--tp", c.ranks_given ? std::to_string(c.ranks) : ""},
          {"--vocab-splits", splits},
          {"--label-smoothing", number(o.label_smoothing)},
          {"--smoothing-semantics", std::to_string(static_cast<int>(o.smoothing_semantics))},
          {"--ignore-index", std::to_string(o.ignore_index)},
          {"--reduction", std::to_string(static_cast<int>(o.reduction))},
          {"--z-loss", number(o.z_loss_weight)},
          {"--logit-scale", number(o.logit_scale)},
          {"--softcap", number(o.softcap)},
          {"--valid-vocab-size", std::to_string(o.valid_vocab_size)},
          {"--extras", c.extras ? "given" : ""},
          {"--in-place", c.in_place ? "given" : ""},
          {"--dtype", c.dtype},
          {"--threads", std::to_string(o.num_threads)},
          {"--timeout", std::to_string(c.timeout_s)},
          {"--backend", c.backend}};
}

constexpr int kMaxFlags = 32;
struct FlagValue {
  uint64_t hash;  // of the flag's name and whole value
  char text[56];  // the value, cut short if longer, for the message
};
struct FlagRecord {
  uint64_t host;  // hash of MPI_Get_processor_name
  FlagValue flags[kMaxFlags];
};

struct StatusRecord {
  int32_t code;
  char message[1020];
};

}  // namespace

Status ToolCollectives::wait(MPI_Request* request, const char* what) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  auto pause = std::chrono::microseconds(20);
  for (int polls = 0;; ++polls) {
    int done = 0;
    if (MPI_Test(request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      return {Code::kRemoteError, std::string("mpi: ") + what + ": MPI_Test failed"};
    }
    if (done) return {};
    if (std::chrono::steady_clock::now() > deadline) {
      return {Code::kTimeout, std::string("mpi: ") + what + ": expected every rank within --timeout " +
                                  std::to_string(timeout_.count() / 1000) + " s, got a rank that did not arrive"};
    }
    // A few quick polls for ranks a moment away, then sleeps growing to 1 ms: no spinning.
    if (polls > 100) {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(1));
    }
  }
}

Status ToolCollectives::all_gather(const void* mine, void* all, int bytes, const char* what) const {
  MPI_Request request = MPI_REQUEST_NULL;
  if (MPI_Iallgather(mine, bytes, MPI_BYTE, all, bytes, MPI_BYTE, MPI_COMM_WORLD, &request) != MPI_SUCCESS) {
    return {Code::kRemoteError, std::string("mpi: ") + what + ": MPI_Iallgather failed"};
  }
  return wait(&request, what);
}

Status ToolCollectives::agree_flags(const RunConfig& config, int* ranks_on_host) const {
  const auto values = flag_values(config);
  FlagRecord mine{};
  char host[MPI_MAX_PROCESSOR_NAME + 1] = {};
  int length = 0;
  MPI_Get_processor_name(host, &length);
  mine.host = fnv1a(std::string(host, static_cast<std::size_t>(std::max(length, 0))));
  for (std::size_t f = 0; f < values.size() && f < kMaxFlags; ++f) {
    mine.flags[f].hash = fnv1a(std::string(values[f].first) + "=" + values[f].second);
    std::snprintf(mine.flags[f].text, sizeof(mine.flags[f].text), "%s", values[f].second.c_str());
  }
  std::vector<FlagRecord> all(static_cast<std::size_t>(ranks_));
  if (Status s = all_gather(&mine, all.data(), sizeof(FlagRecord), "agreeing the flags"); !s.ok()) return s;
  *ranks_on_host =
      static_cast<int>(std::count_if(all.begin(), all.end(), [&](const FlagRecord& r) { return r.host == mine.host; }));
  for (std::size_t f = 0; f < values.size() && f < kMaxFlags; ++f) {
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r].flags[f].hash == all[0].flags[f].hash) continue;
      auto shown = [](const FlagValue& v) { return v.text[0] ? std::string(v.text) : std::string("(not given)"); };
      return {Code::kInvalidArgument, std::string(values[f].first) +
                                          ": expected the same value on every MPI rank, got " + shown(all[0].flags[f]) +
                                          " on rank 0 and " + shown(all[r].flags[f]) + " on rank " + std::to_string(r)};
    }
  }
  return {};
}

Status ToolCollectives::agree(const Status& local) const {
  if (local.code() == Code::kTimeout) return local;
  StatusRecord mine{};
  mine.code = static_cast<int32_t>(local.code());
  if (!local.ok()) std::snprintf(mine.message, sizeof(mine.message), "rank %d: %s", rank_, local.message().c_str());
  std::vector<StatusRecord> all(static_cast<std::size_t>(ranks_));
  if (Status s = all_gather(&mine, all.data(), sizeof(StatusRecord), "agreeing a status"); !s.ok()) return s;
  for (const StatusRecord& r : all) {
    if (r.code != static_cast<int32_t>(Code::kSuccess)) return {static_cast<Code>(r.code), r.message};
  }
  return {};
}

Status ToolCollectives::max(double local, double* out) const {
  MPI_Request request = MPI_REQUEST_NULL;
  if (MPI_Iallreduce(&local, out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD, &request) != MPI_SUCCESS) {
    return {Code::kRemoteError, "mpi: the slowest time: MPI_Iallreduce failed"};
  }
  return wait(&request, "the slowest time");
}

Status ToolCollectives::barrier() const {
  MPI_Request request = MPI_REQUEST_NULL;
  if (MPI_Ibarrier(MPI_COMM_WORLD, &request) != MPI_SUCCESS) return {Code::kRemoteError, "mpi: MPI_Ibarrier failed"};
  return wait(&request, "the final barrier");
}

}  // namespace vpce::tools
