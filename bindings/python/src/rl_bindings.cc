// bindings/python/src/rl_bindings.cc: the RL outputs (vpce/rl.h): log-probabilities and
// entropy, their options, the forward and the backward on logits and in the fused head.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <utility>

#include "arguments.h"
#include "head_operands.h"

namespace vpce::python {
namespace {

// The forward's optional outputs, as the rl::Outputs that points into them.
struct PolicyOutputs {
  PolicyOutputs(nb::handle log_prob, nb::handle entropy, nb::handle lse, nb::handle mean_logit,
                nb::handle sum_p_squared)
      : lp(log_prob, "log_prob"),
        h(entropy, "entropy"),
        e(lse, "lse"),
        mean(mean_logit, "mean_logit"),
        squares(sum_p_squared, "sum_p_squared") {
    views = {lp.get(), h.get(), e.get(), mean.get(), squares.get()};
  }
  OptionalOutput lp, h, e, mean, squares;
  vpce::rl::Outputs views;
};

// The backward's optional upstream gradients, as the rl::Upstream that points into them.
struct PolicyUpstream {
  PolicyUpstream(nb::handle grad_log_prob, nb::handle grad_entropy)
      : lp(grad_log_prob, "grad_log_prob"), h(grad_entropy, "grad_entropy") {
    views = {lp.get(), h.get()};
  }
  OptionalInput lp, h;
  vpce::rl::Upstream views;
};

}  // namespace

void bind_rl(nb::module_& m) {
  auto options = nb::class_<vpce::rl::Options>(m, "RlOptions", "The RL outputs' options; see include/vpce/rl.h");
  options.def(nb::init<>());
  using Rl = vpce::rl::Options;
  def_fields(options, std::pair{"temperature", &Rl::temperature}, std::pair{"ignore_index", &Rl::ignore_index},
             std::pair{"logit_scale", &Rl::logit_scale}, std::pair{"softcap", &Rl::softcap},
             std::pair{"valid_vocab_size", &Rl::valid_vocab_size}, std::pair{"num_threads", &Rl::num_threads});

  m.def(
      "rl_forward",
      [](nb::handle logits, nb::handle targets, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::rl::Options& options, nb::handle log_prob, nb::handle entropy, nb::handle lse,
         nb::handle mean_logit, nb::handle temperatures, int rank, int size, nb::object all_gather,
         nb::handle sum_p_squared) {
        require_all_gather(size, all_gather);
        const Input x(logits, "logits");
        const Input y(targets, "targets");
        const PolicyOutputs out(log_prob, entropy, lse, mean_logit, sum_p_squared);
        const OptionalInput t(temperatures, "temperatures");
        collective(rank, size, std::move(all_gather), [&](vpce::Communicator& comm) {
          return vpce::rl::forward(comm, x, y, shard_of(vocab_begin, vocab_end, vocab_size), options, out.views,
                                   t.get());
        });
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"),
      nb::arg("vocab_size"), nb::arg("options"), nb::arg("log_prob").none() = nb::none(),
      nb::arg("entropy").none() = nb::none(), nb::arg("lse").none() = nb::none(),
      nb::arg("mean_logit").none() = nb::none(), nb::arg("temperatures").none() = nb::none(), nb::arg("rank") = 0,
      nb::arg("size") = 1, nb::arg("all_gather") = nb::none(), nb::arg("sum_p_squared").none() = nb::none(),
      "RL outputs' forward: local statistics, one all_gather(send, recv) through the callable, merge, then "
      "log_prob, entropy, sum_p_squared and, for the backward, lse and mean_logit (each optional).");

  m.def(
      "rl_backward",
      [](nb::handle logits, nb::handle targets, nb::handle lse, nb::handle mean_logit, nb::handle grad_log_prob,
         nb::handle grad_entropy, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::rl::Options& options, nb::handle grad_logits, nb::handle temperatures) {
        const Input x(logits, "logits");
        const Input y(targets, "targets");
        const Input e(lse, "lse");
        const OptionalInput mean(mean_logit, "mean_logit");
        const PolicyUpstream up(grad_log_prob, grad_entropy);
        const Output out(grad_logits, "grad_logits");
        const OptionalInput t(temperatures, "temperatures");
        released([&] {
          return vpce::rl::backward(x, y, e, mean.get(), up.views, shard_of(vocab_begin, vocab_end, vocab_size),
                                    options, out, t.get());
        });
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("lse").none(), nb::arg("mean_logit").none(),
      nb::arg("grad_log_prob").none(), nb::arg("grad_entropy").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"),
      nb::arg("vocab_size"), nb::arg("options"), nb::arg("grad_logits").none(),
      nb::arg("temperatures").none() = nb::none(),
      "RL outputs' backward: no collective; grad_logits may be the logits themselves (in place).");

  m.def(
      "rl_linear_forward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::rl::Options& options, const vpce::HeadOptions& head_options,
         nb::handle log_prob, nb::handle entropy, nb::handle lse, nb::handle mean_logit, nb::handle temperatures,
         int rank, int size, nb::object all_gather, nb::handle sum_p_squared) {
        require_all_gather(size, all_gather);
        const Head operands(hidden, weight, bias);
        const Input y(targets, "targets");
        const PolicyOutputs out(log_prob, entropy, lse, mean_logit, sum_p_squared);
        const OptionalInput t(temperatures, "temperatures");
        collective(rank, size, std::move(all_gather), [&](vpce::Communicator& comm) {
          return vpce::rl::linear_forward(comm, operands.inputs, y, shard_of(vocab_begin, vocab_end, vocab_size),
                                          options, head_options, out.views, t.get(), operands.workspace());
        });
      },
      nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("targets").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("head"),
      nb::arg("log_prob").none() = nb::none(), nb::arg("entropy").none() = nb::none(),
      nb::arg("lse").none() = nb::none(), nb::arg("mean_logit").none() = nb::none(),
      nb::arg("temperatures").none() = nb::none(), nb::arg("rank") = 0, nb::arg("size") = 1,
      nb::arg("all_gather") = nb::none(), nb::arg("sum_p_squared").none() = nb::none(),
      "RL outputs in the fused head (recompute mode): those of hidden @ weight.T + bias without the logits; one "
      "all_gather(send, recv) through the callable. bias may be None.");

  def_with_groups(
      m, "rl_linear_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, nb::handle lse,
         nb::handle mean_logit, nb::handle grad_log_prob, nb::handle grad_entropy, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::rl::Options& options, const vpce::HeadOptions& head_options,
         nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias, bool accumulate_hidden,
         bool accumulate_weight, bool accumulate_bias, nb::handle temperatures) {
        const Head operands(hidden, weight, bias);
        const Input y(targets, "targets");
        const Input e(lse, "lse");
        const OptionalInput mean(mean_logit, "mean_logit");
        const PolicyUpstream up(grad_log_prob, grad_entropy);
        const OptionalInput t(temperatures, "temperatures");
        const Gradients out(grad_hidden, grad_weight, grad_bias, accumulate_hidden, accumulate_weight, accumulate_bias);
        released([&] {
          return vpce::rl::linear_backward(operands.inputs, y, e, mean.get(), up.views,
                                           shard_of(vocab_begin, vocab_end, vocab_size), options, head_options,
                                           out.views, t.get(), operands.workspace());
        });
      },
      "RL outputs in the fused head, backward: no collective; recomputes the tiles, writes or adds the gradients.",
      std::make_tuple(nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(),
                      nb::arg("targets").none(), nb::arg("lse").none(), nb::arg("mean_logit").none(),
                      nb::arg("grad_log_prob").none(), nb::arg("grad_entropy").none(), nb::arg("vocab_begin"),
                      nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("head")),
      gradient_args(), std::make_tuple(nb::arg("temperatures").none() = nb::none()));

  def_with_groups(
      m, "rl_linear_forward_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, nb::handle grad_log_prob,
         nb::handle grad_entropy, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::rl::Options& options, const vpce::HeadOptions& head_options, nb::handle log_prob,
         nb::handle entropy, nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias,
         bool accumulate_hidden, bool accumulate_weight, bool accumulate_bias, nb::handle temperatures, int rank,
         int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const Head operands(hidden, weight, bias);
        const Input y(targets, "targets");
        const PolicyUpstream up(grad_log_prob, grad_entropy);
        const PolicyOutputs out(log_prob, entropy, nb::none(), nb::none(), nb::none());
        const OptionalInput t(temperatures, "temperatures");
        const Gradients gradients(grad_hidden, grad_weight, grad_bias, accumulate_hidden, accumulate_weight,
                                  accumulate_bias);
        int64_t collectives = 0;
        collective(rank, size, std::move(all_gather), [&](vpce::Communicator& comm) {
          return vpce::rl::linear_forward_backward(
              comm, operands.inputs, y, shard_of(vocab_begin, vocab_end, vocab_size), options, head_options, up.views,
              out.views, gradients.views, t.get(), operands.workspace(), &collectives);
        });
        return collectives;
      },
      "RL outputs in the fused head, chunked mode: log_prob and entropy and, with their upstream gradients known "
      "now, the gradients, chunk by chunk; one all_gather per chunk. Returns the number of all_gathers made.",
      std::make_tuple(nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(),
                      nb::arg("targets").none(), nb::arg("grad_log_prob").none(), nb::arg("grad_entropy").none(),
                      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"),
                      nb::arg("head"), nb::arg("log_prob").none() = nb::none(), nb::arg("entropy").none() = nb::none()),
      gradient_args(),
      std::make_tuple(nb::arg("temperatures").none() = nb::none(), nb::arg("rank") = 0, nb::arg("size") = 1,
                      nb::arg("all_gather") = nb::none()));
}

}  // namespace vpce::python
