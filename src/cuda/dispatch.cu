// cuda/dispatch.cu: device tensors behind the public API: which devices are usable, the
// device workspace, and the device forward (local statistics, one gather of device memory
// on the stream, the group check, merge, loss) and backward. Argument checks that need no
// device memory happen on the host before (validate.cc); the rest on the device.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "device.h"
#include "dispatch.h"
#include "host.h"

namespace vpce::detail {

namespace {

std::string device_text(const char* name) { return std::string(name) + ".device"; }

}  // namespace

Status device_supported(Device device, const char* name) {
  if (device.type == DeviceType::kCPU) return {};
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return {Code::kUnsupported,
            expected_got(device_text(name).c_str(),
                         std::string("cpu (no CUDA device is usable here: ") + cudaGetErrorString(e) + ")",
                         to_string(device))};
  }
  if (device.id < 0 || device.id >= count) {
    return {Code::kUnsupported,
            expected_got(device_text(name).c_str(), "cpu or one of the " + std::to_string(count) + " CUDA devices",
                         to_string(device))};
  }
  return {};
}

Status check_device_pointer(const TensorView& t, const char* name) {
  // An empty tensor reads no memory: its address may be null, or one past the end of an
  // allocation, which CUDA does not know.
  if (t.device.type != DeviceType::kCUDA || t.data == nullptr || t.numel() == 0) return {};
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, t.first()) != cudaSuccess) {
    cudaGetLastError();
    return {Code::kInvalidArgument, expected_got((std::string(name) + ".data").c_str(),
                                                 "memory of " + to_string(t.device), "an address CUDA does not know")};
  }
  const bool device_memory = attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  if (device_memory && attributes.device == t.device.id) return {};
  return {Code::kInvalidArgument,
          expected_got((std::string(name) + ".data").c_str(), "memory of " + to_string(t.device),
                       device_memory ? "memory of cuda:" + std::to_string(attributes.device) : "host memory")};
}

struct DeviceWorkspace {
  int device = 0;
  char* send = nullptr;  // this rank's payload: header + [N, W] stats
  std::size_t send_capacity = 0;
  char* recv = nullptr;  // every rank's payload
  std::size_t recv_capacity = 0;
  char* merged = nullptr;  // [N, W] float merged stats, then N doubles of loss terms
  std::size_t merged_capacity = 0;
  char* error_word = nullptr;  // a cuda::DeviceError
  std::size_t error_capacity = 0;
  // What device_status() needs about the last forward.
  cudaStream_t stream = nullptr;
  int ranks = 0;
  int self = 0;
  std::size_t payload = 0;
  bool used = false;
  CallOrder order;  // of the calls on these buffers

  cuda::DeviceError* error() const { return reinterpret_cast<cuda::DeviceError*>(error_word); }

  // Waits for the last call's work, which may still use the buffers, then frees them.
  ~DeviceWorkspace() {
    CurrentDevice current(device);
    order.wait();
    for (char* p : {send, recv, merged, error_word}) {
      if (p != nullptr) cudaFree(p);
    }
  }
};

namespace {

// Grows a device buffer to `bytes` (stream-ordered, so it can follow earlier work). Not
// while the stream is being captured into a graph: memory allocated outside the graph
// cannot be freed inside it.
Status ensure(char** buffer, std::size_t* capacity, std::size_t bytes, cudaStream_t stream) {
  if (bytes <= *capacity) return {};
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (const cudaError_t e = cudaStreamIsCapturing(stream, &capturing); e != cudaSuccess) {
    return cuda_failure("cudaStreamIsCapturing", e);
  }
  if (capturing != cudaStreamCaptureStatusNone) {
    return {Code::kInvalidUsage,
            "workspace: expected device buffers already large enough when capturing a CUDA graph "
            "(run one call of this size first), got a call that needs larger ones"};
  }
  if (*buffer != nullptr) {
    if (const cudaError_t e = cudaFreeAsync(*buffer, stream); e != cudaSuccess) return cuda_failure("cudaFreeAsync", e);
  }
  *buffer = nullptr;
  *capacity = 0;
  if (const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(buffer), bytes, stream); e != cudaSuccess) {
    return cuda_failure("cudaMallocAsync of the workspace", e);
  }
  *capacity = bytes;
  return {};
}

}  // namespace

namespace {

// The protocol's buffers of `w` for one call on `stream` (the caller made `device` current):
// on the device of the workspace's first call, ordered after the last call that used them,
// grown for `ranks` payloads of `payload` bytes and `merged_bytes`, the error word cleared.
Status prepare_protocol(DeviceWorkspace& w, int device, cudaStream_t stream, std::size_t payload, int ranks,
                        std::size_t merged_bytes) {
  if (w.used && w.device != device) {  // (its buffers are that device's memory)
    return {Code::kInvalidUsage, "workspace: expected the device of its first call, cuda:" + std::to_string(w.device) +
                                     ", got cuda:" + std::to_string(device)};
  }
  // The last call may have run on another stream and still use these buffers.
  if (Status s = w.order.before(stream); !s.ok()) return s;
  w.device = device;
  const std::size_t total = payload * static_cast<std::size_t>(ranks);
  // Without its buffers this rank cannot join the gather: the others wait (NCCL has no
  // timeout of its own; the framework's watchdog, or ncclCommAbort, ends it).
  if (Status s = ensure(&w.send, &w.send_capacity, payload, stream); !s.ok()) return s;
  if (Status s = ensure(&w.recv, &w.recv_capacity, total, stream); !s.ok()) return s;
  if (Status s = ensure(&w.merged, &w.merged_capacity, merged_bytes, stream); !s.ok()) return s;
  if (Status s = ensure(&w.error_word, &w.error_capacity, sizeof(cuda::DeviceError), stream); !s.ok()) return s;
  if (const cudaError_t e = cudaMemsetAsync(w.error(), 0, sizeof(cuda::DeviceError), stream); e != cudaSuccess) {
    return cuda_failure("clearing the error word", e);
  }
  return {};
}

}  // namespace

Status device_forward(Communicator& comm, const DeviceForwardArgs& a, std::shared_ptr<void>* state) {
  auto stream = static_cast<cudaStream_t>(a.options.stream);
  const int device = a.device;
  CurrentDevice current(device);
  if (Status s = current.status(); !s.ok()) return s;
  if (!*state) *state = std::make_shared<DeviceWorkspace>();
  auto& w = *static_cast<DeviceWorkspace*>(state->get());
  const int ranks = comm.size();
  const std::size_t merged_bytes = static_cast<std::size_t>(a.tokens * a.width) * sizeof(float) +
                                   static_cast<std::size_t>(a.tokens) * sizeof(double);
  if (Status s = prepare_protocol(w, device, stream, a.payload, ranks, merged_bytes); !s.ok()) return s;
  const CallScope call(w.order, stream);
  auto* header = reinterpret_cast<RankHeader*>(w.send);
  if (Status s = cuda::write_header(a.header, header, stream); !s.ok()) return a.local.ok() ? s : a.local;
  if (a.local.ok()) {
    const RowMatrix stats{w.send + sizeof(RankHeader), kFloat32, a.tokens, a.width, a.width};
    if (Status s =
            cuda::local_stats(a.in.logits, a.in.targets, a.in.weights, a.vocab_begin, a.params, stats, header, stream);
        !s.ok()) {
      return s;
    }
  }
  if (Status s = comm.device_all_gather(w.send, w.recv, a.payload, stream); !s.ok()) return a.local.ok() ? s : a.local;
  if (Status s = cuda::check_group(w.recv, static_cast<int64_t>(a.payload), ranks, w.error(), stream); !s.ok()) {
    return a.local.ok() ? s : a.local;
  }
  w.stream = stream;
  w.ranks = ranks;
  w.self = comm.rank();
  w.payload = a.payload;
  w.used = true;
  if (!a.local.ok()) return a.local;
  if (a.policy.wanted) {
    return cuda::merge_and_policy(reinterpret_cast<const float*>(w.recv + sizeof(RankHeader)),
                                  static_cast<int64_t>(a.payload / sizeof(float)), ranks, a.tokens, a.width,
                                  reinterpret_cast<float*>(w.merged), a.in.targets, a.params, a.policy, w.error(),
                                  stream);
  }
  return cuda::merge_and_loss(
      reinterpret_cast<const float*>(w.recv + sizeof(RankHeader)), static_cast<int64_t>(a.payload / sizeof(float)),
      ranks, a.tokens, a.width, reinterpret_cast<float*>(w.merged), a.in.targets, a.in.weights, a.params, a.out,
      reinterpret_cast<double*>(w.merged + a.tokens * a.width * sizeof(float)), w.error(), stream);
}

Status device_protocol(std::shared_ptr<void>* state, int device, void* stream, int ranks, int self, std::size_t payload,
                       std::size_t merged_bytes, DeviceProtocol* out) {
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  CurrentDevice current(device);
  if (Status s = current.status(); !s.ok()) return s;
  if (!*state) *state = std::make_shared<DeviceWorkspace>();
  auto& w = *static_cast<DeviceWorkspace*>(state->get());
  if (Status s = prepare_protocol(w, device, cuda_stream, payload, ranks, merged_bytes); !s.ok()) return s;
  w.stream = cuda_stream;
  w.ranks = ranks;
  w.self = self;
  w.payload = payload;
  w.used = true;
  *out = DeviceProtocol{w.send, w.recv, w.merged, w.error_word, &w.order};
  return {};
}

Status device_status(void* state) {
  if (state == nullptr) return {};
  auto& w = *static_cast<DeviceWorkspace*>(state);
  if (!w.used) return {};
  CurrentDevice current(w.device);
  if (const cudaError_t e = cudaStreamSynchronize(w.stream); e != cudaSuccess) {
    return cuda_failure("the stream of the last forward", e);
  }
  cuda::DeviceError error{};
  if (const cudaError_t e = cudaMemcpy(&error, w.error(), sizeof(error), cudaMemcpyDeviceToHost); e != cudaSuccess) {
    return cuda_failure("reading the device's error word", e);
  }
  if (error.code == 0) return {};
  // The same bytes the device checked, checked again on the host for the message.
  // (Only the headers: the payloads may be large.)
  std::vector<char> headers(sizeof(RankHeader) * static_cast<std::size_t>(w.ranks));
  if (const cudaError_t e = cudaMemcpy2D(headers.data(), sizeof(RankHeader), w.recv, w.payload, sizeof(RankHeader),
                                         static_cast<std::size_t>(w.ranks), cudaMemcpyDeviceToHost);
      e != cudaSuccess) {
    return cuda_failure("reading the gathered headers", e);
  }
  Status s = check_group(headers.data(), sizeof(RankHeader), w.ranks, w.self);
  if (s.ok()) return {Code::kInternalError, "cuda: the device's group check failed where the host's passed"};
  return s;
}

Status device_backward(const DeviceBackwardArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.options.stream);
  CurrentDevice current(a.device);
  if (Status s = current.status(); !s.ok()) return s;
  if (a.policy.wanted) {
    return cuda::gradient(a.in.logits, a.in.targets, a.in.weights, a.lse, a.grad_loss, a.vocab_begin, a.params, a.grad,
                          nullptr, stream, &a.policy);
  }
  double* shared = nullptr;
  if (a.params.reduction != Reduction::kNone) {
    if (const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&shared), sizeof(double), stream);
        e != cudaSuccess) {
      return cuda_failure("cudaMallocAsync of the upstream gradient", e);
    }
  }
  const Status s = cuda::gradient(a.in.logits, a.in.targets, a.in.weights, a.lse, a.grad_loss, a.vocab_begin, a.params,
                                  a.grad, shared, stream);
  if (shared != nullptr) {
    if (const cudaError_t e = cudaFreeAsync(shared, stream); e != cudaSuccess && s.ok()) {
      return cuda_failure("cudaFreeAsync of the upstream gradient", e);
    }
  }
  return s;
}

}  // namespace vpce::detail
