// loss/forward.cc: the one-call forward: local stats, one all-gather, agreement check, merge,
// loss. Outputs are written only after every rank's arguments have been checked.
#include <cstring>
#include <new>
#include <vector>

#include "cpu/kernels.h"
#include "cuda/dispatch.h"
#include "exchange.h"
#include "protocol.h"
#include "validate.h"
#include "workspace.h"
#include "vpce/loss.h"

namespace vpce {

namespace {

using detail::LossInputs;
using detail::RowMatrix;
using detail::TokenVector;

// The loss's block of the forward's header: its name and mode; nothing else to agree on.
detail::OperationBlock loss_operation() { return detail::operation_block("loss on logits", "forward"); }

// Every tensor of a device forward, for the check that each is memory of its device.
struct DeviceTensors {
  const TensorView* logits;
  const TensorView* targets;
  const TensorView* weights;
  const TensorView* loss;
  const TensorView* lse;
  const TensorView* target_is_argmax;
  const TensorView* entropy;
};

// The forward on device tensors: the same header and protocol as on the CPU, with the
// buffers, kernels and gather on the device (cuda/dispatch.cu).
Status device_forward(Communicator& comm, const LossInputs& in, const detail::LossOutputs& out, int64_t n,
                      int64_t width, const VocabShard& shard, DataType dtype, const LossOptions& options,
                      const ForwardExtras& extras, Workspace* workspace, Status local, const DeviceTensors& tensors) {
  if (local.ok() && workspace == nullptr) {
    local = {Code::kInvalidArgument,
             "workspace: expected a Workspace for device tensors (it holds the device buffers and the asynchronous "
             "error), got null"};
  }
  const std::pair<const TensorView*, const char*> views[] = {
      {tensors.logits, "logits"},  {tensors.targets, "targets"}, {tensors.weights, "weights"},
      {tensors.loss, "loss"},      {tensors.lse, "lse"},         {tensors.target_is_argmax, "target_is_argmax"},
      {tensors.entropy, "entropy"}};
  for (const auto& [view, name] : views) {
    if (!local.ok()) break;
    if (view != nullptr) local = detail::check_device_pointer(*view, name);
  }
  detail::WorkspaceLease lease(workspace);  // (none given, or held: this rank's error, but it still joins)
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  detail::RankHeader header = detail::make_header(comm.rank(), comm.size(), n, width, shard, dtype, options,
                                                  extras.weights != nullptr, 0, loss_operation(), local);
  detail::set_device_found_message(header, shard, options);
  detail::DeviceForwardArgs args{in,
                                 out,
                                 header,
                                 local,
                                 detail::payload_bytes(n, width),
                                 n,
                                 width,
                                 shard.vocab_begin,
                                 detail::loss_params(options, shard),
                                 options,
                                 tensors.logits->device.id};
  return detail::device_forward(comm, args, &buffers->device);
}

}  // namespace

Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets, const VocabShard& shard,
               const LossOptions& options, const TensorView& loss, const TensorView& lse, const ForwardExtras& extras,
               Workspace* workspace) {
  if (Status s = detail::check_comm(comm); !s.ok()) return s;

  LossInputs in;
  detail::LossOutputs out;
  Status local = detail::check_loss_inputs(logits, targets, extras.weights, shard, options, &in);
  if (local.ok()) {
    local = detail::check_forward_outputs(
        in.logits.rows, logits.device, options, loss, lse, extras,
        {detail::region_of("the logits", in.logits), detail::region_of("the targets", in.targets),
         detail::region_of("the weights", in.weights)},
        &out);
  }
  int64_t n = local.ok() ? in.logits.rows : detail::announced_tokens(targets);
  const bool with_extras = extras.target_is_argmax != nullptr || extras.entropy != nullptr;
  const int64_t width = with_extras ? kStatsWidthWithExtras : kStatsWidth;

  if (logits.device.type == DeviceType::kCUDA && detail::device_supported(logits.device, "logits").ok()) {
    return device_forward(comm, in, out, n, width, shard, logits.dtype, options, extras, workspace, local,
                          {&logits, &targets, extras.weights, &loss, &lse, extras.target_is_argmax, extras.entropy});
  }

  detail::WorkspaceLease lease(workspace);
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  detail::ExchangeCall call;
  call.tokens = n;
  call.width = width;
  call.shard = shard;
  call.dtype = logits.dtype;
  call.options = options;
  call.has_weights = extras.weights != nullptr;
  call.inputs_hash = in.inputs_hash;
  call.operation = loss_operation();
  const detail::LossParams params = detail::loss_params(options, shard);
  RowMatrix merged;
  Status group = detail::exchange_stats(
      comm, *buffers, call, local,
      [&](const RowMatrix& stats) {
        detail::local_stats_kernel(in.logits, in.targets, shard.vocab_begin, params, options.num_threads, stats);
        return Status{};
      },
      &merged);
  if (!group.ok()) return group;
  detail::loss_kernel(merged, in.targets, in.weights, params, options.num_threads, out);
  return {};
}

}  // namespace vpce
