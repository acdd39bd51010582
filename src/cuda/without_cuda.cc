// cuda/without_cuda.cc: the device entry points of a build without CUDA. device_supported()
// refuses every device but the CPU, so the others are never reached with device tensors.
#include "dispatch.h"

namespace vpce::detail {

namespace {
Status no_cuda() { return {Code::kUnsupported, "this build of vpce has no CUDA support"}; }
}  // namespace

Status device_supported(Device device, const char* name) {
  if (device.type == DeviceType::kCPU) return {};
  return {Code::kUnsupported, expected_got((std::string(name) + ".device").c_str(),
                                           "cpu (this build of vpce has no CUDA support)", to_string(device))};
}

Status check_device_pointer(const TensorView&, const char*) { return {}; }

Status device_forward(Communicator&, const DeviceForwardArgs&, std::shared_ptr<void>*) { return no_cuda(); }

Status device_status(void*) { return {}; }

Status device_backward(const DeviceBackwardArgs&) { return no_cuda(); }

}  // namespace vpce::detail
