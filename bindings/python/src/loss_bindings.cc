// bindings/python/src/loss_bindings.cc: the loss on logits (vpce/loss.h): its options, the
// one-call forward and backward, and the staged API.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "arguments.h"

namespace vpce::python {

void bind_loss(nb::module_& m) {
  nb::enum_<vpce::Reduction>(m, "Reduction")
      .value("NONE", vpce::Reduction::kNone)
      .value("SUM", vpce::Reduction::kSum)
      .value("MEAN", vpce::Reduction::kMean);
  nb::enum_<vpce::SmoothingSemantics>(m, "SmoothingSemantics")
      .value("MEGATRON", vpce::SmoothingSemantics::kMegatron)
      .value("PYTORCH", vpce::SmoothingSemantics::kPyTorch)
      .value("MEGATRON_LEGACY", vpce::SmoothingSemantics::kMegatronLegacy);

  auto options = nb::class_<vpce::LossOptions>(m, "LossOptions", "Every loss option; see include/vpce/loss.h");
  options.def(nb::init<>());
  // (Not the CUDA stream, which Python does not set.)
  using Loss = vpce::LossOptions;
  def_fields(options, std::pair{"label_smoothing", &Loss::label_smoothing},
             std::pair{"smoothing_semantics", &Loss::smoothing_semantics},
             std::pair{"ignore_index", &Loss::ignore_index}, std::pair{"z_loss_weight", &Loss::z_loss_weight},
             std::pair{"logit_scale", &Loss::logit_scale}, std::pair{"softcap", &Loss::softcap},
             std::pair{"valid_vocab_size", &Loss::valid_vocab_size}, std::pair{"reduction", &Loss::reduction},
             std::pair{"num_threads", &Loss::num_threads});

  m.attr("STATS_WIDTH") = vpce::kStatsWidth;
  m.attr("STATS_WIDTH_WITH_EXTRAS") = vpce::kStatsWidthWithExtras;

  m.def(
      "forward",
      [](nb::handle logits, nb::handle targets, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, nb::handle loss, nb::handle lse, nb::handle weights,
         nb::handle target_is_argmax, nb::handle entropy, int rank, int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const Input x(logits, "logits");
        const Input y(targets, "targets");
        const Output l(loss, "loss");
        const Output e(lse, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        collective(rank, size, std::move(all_gather), [&](vpce::Communicator& comm) {
          return vpce::forward(comm, x, y, shard_of(vocab_begin, vocab_end, vocab_size), options, l, e, extras.views);
        });
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"),
      nb::arg("vocab_size"), nb::arg("options"), nb::arg("loss").none(), nb::arg("lse").none(),
      nb::arg("weights").none() = nb::none(), nb::arg("target_is_argmax").none() = nb::none(),
      nb::arg("entropy").none() = nb::none(), nb::arg("rank") = 0, nb::arg("size") = 1,
      nb::arg("all_gather") = nb::none(),
      "One-call forward: local statistics, one all_gather(send, recv) through the callable, merge, loss.");

  m.def(
      "backward",
      [](nb::handle logits, nb::handle targets, nb::handle lse, nb::handle grad_loss, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, nb::handle grad_logits,
         nb::handle weights) {
        const Input x(logits, "logits");
        const Input y(targets, "targets");
        const Input e(lse, "lse");
        const Input g(grad_loss, "grad_loss");
        const Output out(grad_logits, "grad_logits");
        const OptionalInput w(weights, "weights");
        released([&] {
          return vpce::backward(x, y, e, g, shard_of(vocab_begin, vocab_end, vocab_size), options, out, w.get());
        });
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("lse").none(), nb::arg("grad_loss").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"),
      nb::arg("grad_logits").none(), nb::arg("weights").none() = nb::none(),
      "Backward: no collective; grad_logits may be the logits themselves (in place).");

  m.def(
      "calculate_local_stats",
      [](nb::handle logits, nb::handle targets, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, nb::handle stats) {
        const Input x(logits, "logits");
        const Input y(targets, "targets");
        const Output s(stats, "stats");
        released([&] {
          return vpce::calculate_local_stats(x, y, shard_of(vocab_begin, vocab_end, vocab_size), options, s);
        });
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"),
      nb::arg("vocab_size"), nb::arg("options"), nb::arg("stats").none(),
      "Staged 1: this rank's [N, 4] (or [N, 6]) float32 statistics.");

  m.def(
      "merge_stats",
      [](nb::handle gathered, const vpce::LossOptions& options, nb::handle stats,
         const std::vector<std::tuple<int64_t, int64_t, int64_t>>& shards) {
        const Input g(gathered, "gathered");
        const Output s(stats, "stats");
        std::vector<vpce::VocabShard> ranges;
        for (const auto& [begin, end, size] : shards) ranges.push_back(shard_of(begin, end, size));
        released([&] { return vpce::merge_stats(g, options, s, ranges); });
      },
      nb::arg("gathered").none(), nb::arg("options"), nb::arg("stats").none(),
      nb::arg("shards") = std::vector<std::tuple<int64_t, int64_t, int64_t>>{},
      "Staged 2: [R, N, W] -> [N, W], in rank order. shards: each rank's (vocab_begin, vocab_end, "
      "vocab_size), in rank order; needed with label smoothing when R > 1.");

  m.def(
      "calculate_loss",
      [](nb::handle stats, nb::handle targets, int64_t vocab_size, const vpce::LossOptions& options, nb::handle loss,
         nb::handle lse, nb::handle weights, nb::handle target_is_argmax, nb::handle entropy) {
        const Input s(stats, "stats");
        const Input y(targets, "targets");
        const Output l(loss, "loss");
        const Output e(lse, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        released([&] { return vpce::calculate_loss(s, y, vocab_size, options, l, e, extras.views); });
      },
      nb::arg("stats").none(), nb::arg("targets").none(), nb::arg("vocab_size"), nb::arg("options"),
      nb::arg("loss").none(), nb::arg("lse").none(), nb::arg("weights").none() = nb::none(),
      nb::arg("target_is_argmax").none() = nb::none(), nb::arg("entropy").none() = nb::none(),
      "Staged 3: merged statistics -> loss, lse and the extras.");
}

}  // namespace vpce::python
