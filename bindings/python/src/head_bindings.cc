// bindings/python/src/head_bindings.cc: the fused head (vpce/head.h): linear + cross-entropy
// without the logits, its options, both modes, the staged statistics and the hidden
// gradient's reduction.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <tuple>
#include <utility>

#include "arguments.h"
#include "head_operands.h"

namespace vpce::python {

void bind_head(nb::module_& m) {
  // ---- the fused head (vpce/head.h): linear + cross-entropy without the logits ----------
  auto head = nb::class_<vpce::HeadOptions>(m, "HeadOptions",
                                            "Tile and chunk sizes, the gradients' precision; see include/vpce/head.h");
  head.def(nb::init<>());
  using HeadOpts = vpce::HeadOptions;
  def_fields(head, std::pair{"token_block", &HeadOpts::token_block}, std::pair{"vocab_block", &HeadOpts::vocab_block},
             std::pair{"chunk_tokens", &HeadOpts::chunk_tokens},
             std::pair{"bf16_logit_gradients", &HeadOpts::bf16_logit_gradients},
             std::pair{"round_logits", &HeadOpts::round_logits});

  m.def(
      "linear_cross_entropy_forward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, const vpce::HeadOptions& head_options,
         nb::handle loss, nb::handle lse, nb::handle weights, nb::handle target_is_argmax, nb::handle entropy, int rank,
         int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const Head operands(hidden, weight, bias);
        const Input y(targets, "targets");
        const Output l(loss, "loss");
        const Output e(lse, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        collective(rank, size, std::move(all_gather), [&](vpce::Communicator& comm) {
          return vpce::linear_cross_entropy_forward(comm, operands.inputs, y,
                                                    shard_of(vocab_begin, vocab_end, vocab_size), options, head_options,
                                                    l, e, extras.views, operands.workspace());
        });
      },
      nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("targets").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("head"),
      nb::arg("loss").none(), nb::arg("lse").none(), nb::arg("weights").none() = nb::none(),
      nb::arg("target_is_argmax").none() = nb::none(), nb::arg("entropy").none() = nb::none(), nb::arg("rank") = 0,
      nb::arg("size") = 1, nb::arg("all_gather") = nb::none(),
      "Fused head, recompute mode: the loss of hidden @ weight.T + bias without the logits; one "
      "all_gather(send, recv) through the callable. bias may be None.");

  def_with_groups(
      m, "linear_cross_entropy_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, nb::handle lse,
         nb::handle grad_loss, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, const vpce::HeadOptions& head_options, nb::handle grad_hidden,
         nb::handle grad_weight, nb::handle grad_bias, bool accumulate_hidden, bool accumulate_weight,
         bool accumulate_bias, nb::handle weights) {
        const Head operands(hidden, weight, bias);
        const Input y(targets, "targets");
        const Input e(lse, "lse");
        const Input g(grad_loss, "grad_loss");
        const OptionalInput w(weights, "weights");
        const Gradients gradients(grad_hidden, grad_weight, grad_bias, accumulate_hidden, accumulate_weight,
                                  accumulate_bias);
        released([&] {
          return vpce::linear_cross_entropy_backward(operands.inputs, y, e, g,
                                                     shard_of(vocab_begin, vocab_end, vocab_size), options,
                                                     head_options, gradients.views, w.get(), operands.workspace());
        });
      },
      "Fused head backward: no collective; recomputes the logit tiles and writes (or, with accumulate_*, adds "
      "into float32) the gradients given; None for one not wanted. grad_hidden is this rank's part.",
      std::make_tuple(nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(),
                      nb::arg("targets").none(), nb::arg("lse").none(), nb::arg("grad_loss").none(),
                      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"),
                      nb::arg("head")),
      gradient_args(), std::make_tuple(nb::arg("weights").none() = nb::none()));

  def_with_groups(
      m, "linear_cross_entropy_forward_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, const vpce::HeadOptions& head_options,
         float grad_loss, nb::handle loss, nb::handle lse, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, bool accumulate_hidden, bool accumulate_weight, bool accumulate_bias, nb::handle weights,
         nb::handle target_is_argmax, nb::handle entropy, int rank, int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const Head operands(hidden, weight, bias);
        const Input y(targets, "targets");
        const Output l(loss, "loss");
        const Output e(lse, "lse");
        const Gradients gradients(grad_hidden, grad_weight, grad_bias, accumulate_hidden, accumulate_weight,
                                  accumulate_bias);
        const Extras extras(weights, target_is_argmax, entropy);
        int64_t collectives = 0;
        collective(rank, size, std::move(all_gather), [&](vpce::Communicator& comm) {
          return vpce::linear_cross_entropy_forward_backward(
              comm, operands.inputs, y, shard_of(vocab_begin, vocab_end, vocab_size), options, head_options, grad_loss,
              l, e, gradients.views, extras.views, operands.workspace(), &collectives);
        });
        return collectives;
      },
      "Fused head, chunked mode (reduction sum or mean): the loss and, with the upstream gradient grad_loss known "
      "now, the gradients, chunk by chunk; one all_gather per chunk. Returns the number of all_gathers made.",
      std::make_tuple(nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(),
                      nb::arg("targets").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"),
                      nb::arg("options"), nb::arg("head"), nb::arg("grad_loss"), nb::arg("loss").none(),
                      nb::arg("lse").none()),
      gradient_args(),
      std::make_tuple(nb::arg("weights").none() = nb::none(), nb::arg("target_is_argmax").none() = nb::none(),
                      nb::arg("entropy").none() = nb::none(), nb::arg("rank") = 0, nb::arg("size") = 1,
                      nb::arg("all_gather") = nb::none()));

  m.def(
      "linear_cross_entropy_local_stats",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, const vpce::HeadOptions& head_options,
         nb::handle stats) {
        const Head operands(hidden, weight, bias);
        const Input y(targets, "targets");
        const Output s(stats, "stats");
        released([&] {
          return vpce::linear_cross_entropy_local_stats(
              operands.inputs, y, shard_of(vocab_begin, vocab_end, vocab_size), options, head_options, s);
        });
      },
      nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("targets").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("head"),
      nb::arg("stats").none(),
      "Fused head, staged 1: this rank's [N, 4] (or [N, 6]) float32 statistics of its logits, without them.");

  m.def(
      "all_reduce_hidden_gradient",
      [](nb::handle grad_hidden, int rank, int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const Output g(grad_hidden, "grad_hidden");
        collective(rank, size, std::move(all_gather),
                   [&](vpce::Communicator& comm) { return vpce::all_reduce_hidden_gradient(comm, g); });
      },
      nb::arg("grad_hidden").none(), nb::arg("rank") = 0, nb::arg("size") = 1, nb::arg("all_gather") = nb::none(),
      "grad_hidden (float32, this rank's part) <- the sum of every rank's part, in rank order (the same bits on "
      "every rank), through all_gather(send, recv) calls of at most 64 MiB per rank.");
}

}  // namespace vpce::python
