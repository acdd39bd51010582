// mpi_communicator.cc: the MPI backend's one collective, with size agreement and a timeout.
//
// Wire format: every rank contributes one block of `capacity` bytes (a multiple of 16,
// agreed by all ranks because it only ever changes as a function of gathered data):
//   [BlockHeader: magic, flags, payload bytes][payload, when it fits][padding]
// A call whose payload fits the capacity is one all-gather. Otherwise the first gather
// carries only the headers, every rank learns the new size (or the disagreement) from the
// same bytes, and a second gather of the grown blocks follows.
#include "vpce/mpi.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "../gather_size_hint.h"

namespace vpce {
namespace {

struct BlockHeader {
  static constexpr uint32_t kMagic = 0x4950504d;  // "MPPI"
  static constexpr uint32_t kCannotAllocate = 1;  // flags: this rank cannot grow its buffers
  static constexpr uint32_t kNullBuffer = 2;      // flags: this rank passed a null buffer

  uint32_t magic = kMagic;
  uint32_t flags = 0;
  uint64_t bytes = 0;  // the payload this rank passed to all_gather
};
static_assert(sizeof(BlockHeader) == 16);

constexpr std::size_t kUnit = 16;           // bytes per element of the MPI datatype
constexpr std::size_t kMinCapacity = 4096;  // the first block size
constexpr std::size_t kMaxCapacity = kUnit * static_cast<std::size_t>(INT_MAX);
constexpr std::chrono::milliseconds kMaxTimeout{std::chrono::hours(24 * 30)};

std::size_t block_bytes(std::size_t payload) { return (sizeof(BlockHeader) + payload + kUnit - 1) / kUnit * kUnit; }

std::string mpi_error(const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string("mpi: ") + call + " failed: " + std::string(text, static_cast<std::size_t>(std::max(length, 0)));
}

}  // namespace

struct MpiCommunicator::State {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Datatype unit = MPI_DATATYPE_NULL;
  int rank = 0;
  int size = 0;
  MpiOptions options;
  std::size_t capacity = kMinCapacity;
  std::vector<std::byte> send_block;
  std::vector<std::byte> recv_blocks;
  MPI_Request pending = MPI_REQUEST_NULL;  // a timed-out collective that may still write into the blocks
  std::string broken;                      // why the communicator is unusable; empty while it is fine

  // One collective: gathers `capacity` bytes of send_block from every rank into
  // recv_blocks, waiting at most options.timeout.
  Status gather();
  // Waits for `request` until the deadline; marks the communicator broken on failure.
  Status wait(MPI_Request* request, const char* call);
  Status fail(Code code, std::string message) {
    broken = message;
    return {code, std::move(message)};
  }
};

Status MpiCommunicator::State::wait(MPI_Request* request, const char* call) {
  if (options.timeout.count() == 0) {
    if (const int rc = MPI_Wait(request, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
      pending = *request;
      return fail(Code::kRemoteError, mpi_error("MPI_Wait", rc));
    }
    return {};
  }
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options.timeout;
  auto pause = std::chrono::microseconds(20);
  for (int spins = 0;;) {
    int done = 0;
    if (const int rc = MPI_Test(request, &done, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
      pending = *request;
      return fail(Code::kRemoteError, mpi_error("MPI_Test", rc));
    }
    if (done) return {};
    if (spins < 1024) {  // the common case: the others are a few microseconds away
      ++spins;
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now > deadline) {
      pending = *request;
      return fail(Code::kTimeout, std::string("mpi: ") + call + ": not every rank of the group arrived within " +
                                      std::to_string(options.timeout.count()) + " ms");
    }
    // Yield for the first millisecond; past it a rank is late (stopped, or far behind), so
    // sleep between polls, growing to 1 ms, rather than keep a core busy until the timeout.
    if (now - start < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(1));
    }
  }
}

Status MpiCommunicator::State::gather() {
  // Always MPI_Iallgather, also without a timeout: MPI does not match a blocking collective
  // on one rank with a non-blocking one on another, and ranks may differ in their timeouts.
  const int count = static_cast<int>(capacity / kUnit);
  MPI_Request request = MPI_REQUEST_NULL;
  if (const int rc = MPI_Iallgather(send_block.data(), count, unit, recv_blocks.data(), count, unit, comm, &request);
      rc != MPI_SUCCESS) {
    return fail(Code::kRemoteError, mpi_error("MPI_Iallgather", rc));
  }
  return wait(&request, "all_gather");
}

MpiCommunicator::MpiCommunicator(std::unique_ptr<State> state) : state_(std::move(state)) {}

MpiCommunicator::~MpiCommunicator() {
  if (!state_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (state_->pending != MPI_REQUEST_NULL) {
    // A timed-out collective cannot be cancelled. If it has completed since (the late rank
    // arrived), all is well; if not, MPI may still write into the blocks, so leave the
    // state (a few blocks of memory) alive rather than risk a write into freed memory.
    int done = 0;
    if (finalized || MPI_Test(&state_->pending, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) {
      static_cast<void>(state_.release());
      return;
    }
  }
  if (finalized) return;
  if (state_->unit != MPI_DATATYPE_NULL) MPI_Type_free(&state_->unit);
  if (state_->comm != MPI_COMM_NULL) MPI_Comm_free(&state_->comm);
}

Status MpiCommunicator::create(MPI_Comm comm, std::unique_ptr<MpiCommunicator>* out, const MpiOptions& options) {
  if (out == nullptr) return {Code::kInvalidArgument, "out: expected a non-null pointer, got null"};
  out->reset();
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return {Code::kInvalidUsage, std::string("MPI: expected an initialised MPI library, got one that is ") +
                                     (finalized ? "finalised" : "not initialised (call MPI_Init first)")};
  }
  if (comm == MPI_COMM_NULL) return {Code::kInvalidArgument, "comm: expected a communicator, got MPI_COMM_NULL"};
  if (options.timeout.count() < 0 || options.timeout > kMaxTimeout) {
    return {Code::kInvalidArgument, "options.timeout: expected 0 (none) to " + std::to_string(kMaxTimeout.count()) +
                                        " ms, got " + std::to_string(options.timeout.count()) + " ms"};
  }
  int inter = 0;
  if (const int rc = MPI_Comm_test_inter(comm, &inter); rc != MPI_SUCCESS) {
    return {Code::kInvalidArgument, mpi_error("MPI_Comm_test_inter", rc)};
  }
  if (inter) return {Code::kInvalidArgument, "comm: expected an intra-communicator, got an inter-communicator"};

  auto state = std::make_unique<State>();
  state->options = options;
  MPI_Request request = MPI_REQUEST_NULL;
  if (const int rc = MPI_Comm_idup(comm, &state->comm, &request); rc != MPI_SUCCESS) {
    return {Code::kRemoteError, mpi_error("MPI_Comm_idup", rc)};
  }
  if (Status s = state->wait(&request, "create"); !s.ok()) {
    static_cast<void>(state.release());  // the duplication may complete later, into this state
    return s;
  }
  // From here the state owns a communicator: the destructor of `owner` frees it on failure.
  MpiCommunicator owner(std::move(state));
  State& st = *owner.state_;
  MPI_Comm_set_errhandler(st.comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(st.comm, &st.rank);
  MPI_Comm_size(st.comm, &st.size);
  bool ready = MPI_Type_contiguous(static_cast<int>(kUnit), MPI_BYTE, &st.unit) == MPI_SUCCESS &&
               MPI_Type_commit(&st.unit) == MPI_SUCCESS;
  try {
    st.send_block.resize(kMinCapacity);
    st.recv_blocks.resize(kMinCapacity * static_cast<std::size_t>(st.size));
  } catch (const std::exception&) {
    ready = false;
  }
  // Every rank learns whether every rank is ready, so that all succeed or all fail.
  int first_failed = ready ? st.size : st.rank;
  MPI_Request agreement = MPI_REQUEST_NULL;
  if (const int rc = MPI_Iallreduce(MPI_IN_PLACE, &first_failed, 1, MPI_INT, MPI_MIN, st.comm, &agreement);
      rc != MPI_SUCCESS) {
    return {Code::kRemoteError, mpi_error("MPI_Iallreduce", rc)};
  }
  if (Status s = st.wait(&agreement, "create"); !s.ok()) return s;
  if (first_failed < st.size) {
    return {Code::kSystemError,
            "mpi: rank " + std::to_string(first_failed) + " could not allocate its first blocks or its MPI datatype"};
  }
  out->reset(new MpiCommunicator(std::move(owner.state_)));
  return {};
}

int MpiCommunicator::rank() const { return state_->rank; }
int MpiCommunicator::size() const { return state_->size; }
std::size_t MpiCommunicator::capacity() const { return state_->capacity; }

Status MpiCommunicator::set_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0 || timeout > kMaxTimeout) {
    return {Code::kInvalidArgument, "timeout: expected 0 (none) to " + std::to_string(kMaxTimeout.count()) +
                                        " ms, got " + std::to_string(timeout.count()) + " ms"};
  }
  state_->options.timeout = timeout;
  return {};
}

Status MpiCommunicator::all_gather(const void* send, void* recv, std::size_t bytes) {
  State& s = *state_;
  if (!s.broken.empty()) {
    return {Code::kInvalidUsage, "mpi: the communicator is broken by an earlier failure (" + s.broken + ")"};
  }
  const std::size_t ranks = static_cast<std::size_t>(s.size);
  const std::size_t wanted = bytes > kMaxCapacity ? kMaxCapacity + kUnit : block_bytes(bytes);
  const bool fits = wanted <= s.capacity;

  BlockHeader header;
  header.bytes = bytes;
  // A rank with bad arguments still joins the collective, so that every rank learns of it.
  const bool null_buffer = bytes > 0 && (send == nullptr || recv == nullptr);
  if (null_buffer) header.flags |= BlockHeader::kNullBuffer;
  if (!fits && !null_buffer) {
    // Grow now, before anyone commits to a second gather, and tell the others if we cannot.
    try {
      if (wanted > kMaxCapacity) throw std::bad_alloc();
      s.send_block.resize(wanted);
      s.recv_blocks.resize(wanted * ranks);
    } catch (const std::exception&) {
      header.flags |= BlockHeader::kCannotAllocate;
    }
  }
  std::memcpy(s.send_block.data(), &header, sizeof(header));
  if (fits && !null_buffer && bytes > 0) std::memcpy(s.send_block.data() + sizeof(header), send, bytes);
  if (Status st = s.gather(); !st.ok()) return st;

  // Every rank decides from the same gathered headers, so every rank decides the same and
  // builds the same message (from rank 0's size, never from its own).
  uint64_t agreed = 0;
  uint32_t flags = 0;
  int flagged = -1;  // the first rank with a flag
  for (std::size_t r = 0; r < ranks; ++r) {
    BlockHeader other;
    std::memcpy(&other, s.recv_blocks.data() + r * s.capacity, sizeof(other));
    if (other.magic != BlockHeader::kMagic) {
      return s.fail(Code::kRemoteError, "mpi: rank " + std::to_string(r) +
                                            " sent a block that is not a vpce block (another library on this "
                                            "communicator, or a different vpce version)");
    }
    if (r == 0) agreed = other.bytes;
    if (other.bytes != agreed) {
      return {Code::kInvalidUsage, "all_gather: expected every rank to send the same number of bytes, got " +
                                       std::to_string(agreed) + " from rank 0 and " + std::to_string(other.bytes) +
                                       " from rank " + std::to_string(r) + detail::kGatherSizeHint};
    }
    if (other.flags != 0 && flagged < 0) {
      flags = other.flags;
      flagged = static_cast<int>(r);
    }
  }
  if (flags & BlockHeader::kNullBuffer) {
    return {Code::kInvalidArgument, "all_gather: expected non-null send and recv buffers for " +
                                        std::to_string(agreed) + " bytes, got a null one on rank " +
                                        std::to_string(flagged)};
  }
  if (flags & BlockHeader::kCannotAllocate) {
    return {Code::kSystemError, "mpi: rank " + std::to_string(flagged) + " cannot allocate the all_gather blocks for " +
                                    std::to_string(agreed) + " bytes per rank"};
  }

  if (!fits) {
    s.capacity = wanted;
    std::memcpy(s.send_block.data() + sizeof(header), send, bytes);  // bytes > 0: it did not fit
    if (Status st = s.gather(); !st.ok()) return st;
  }
  for (std::size_t r = 0; r < ranks && bytes > 0; ++r) {
    std::memcpy(static_cast<std::byte*>(recv) + r * bytes, s.recv_blocks.data() + r * s.capacity + sizeof(header),
                bytes);
  }
  // Shrink the blocks (not the buffers) when the payload has become much smaller, so that
  // small calls do not carry a large padding. All ranks agree on `wanted` here.
  if (wanted * 4 < s.capacity) s.capacity = std::max(kMinCapacity, wanted);
  return {};
}

}  // namespace vpce
