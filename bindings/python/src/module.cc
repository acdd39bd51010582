// bindings/python/src/module.cc: the vpce._vpce extension (nanobind).
//
// Exposes the one-call and staged APIs over any DLPack tensor (PyTorch, NumPy, JAX, CuPy):
// arguments are nb::ndarray, turned into vpce::TensorView without a copy. It never links
// libtorch, so one build serves every PyTorch version. The forward's one collective is a
// Python callable all_gather(send, recv) given writable memoryviews (send: this rank's
// payload; recv: size x payload bytes, rank 0's first), so that the framework's own
// process group carries it. The GIL is released while the kernels run and taken again only
// for that callable. A vpce error raises vpce.Error ("invalid argument: targets: ...").
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "vpce/version.h"
#include "vpce/vpce.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::ro>;         // any dtype, device, layout; read through
using MutableArray = nb::ndarray<>;        // written through

struct StatusError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(const vpce::Status& status) {
  if (!status.ok()) throw StatusError(status.to_string());
}

template <class A>
vpce::TensorView view(const A& a, const char* name) {
  if (a.ndim() > static_cast<size_t>(vpce::TensorView::kMaxDims)) {
    throw StatusError(std::string("invalid argument: ") + name + ".ndim: expected at most " +
                      std::to_string(vpce::TensorView::kMaxDims) + ", got " + std::to_string(a.ndim()));
  }
  vpce::TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.device = {static_cast<vpce::DeviceType>(a.device_type()), a.device_id()};
  v.ndim = static_cast<int32_t>(a.ndim());
  const nb::dlpack::dtype t = a.dtype();
  v.dtype = {static_cast<vpce::TypeCode>(t.code), t.bits, t.lanes};
  for (size_t d = 0; d < a.ndim(); ++d) {
    v.shape[d] = static_cast<int64_t>(a.shape(d));
    v.strides[d] = a.stride(d);
  }
  return v;
}

template <class A>
std::optional<vpce::TensorView> optional_view(const std::optional<A>& a, const char* name) {
  if (!a) return std::nullopt;
  return view(*a, name);
}

// The optional per-token tensors of a forward, as views that ForwardExtras points into
// (so the object must stay where it is while the call runs).
struct Extras {
  Extras(const std::optional<Array>& weights, const std::optional<MutableArray>& target_is_argmax,
         const std::optional<MutableArray>& entropy)
      : w(optional_view(weights, "weights")),
        a(optional_view(target_is_argmax, "target_is_argmax")),
        h(optional_view(entropy, "entropy")) {
    views.weights = w ? &*w : nullptr;
    views.target_is_argmax = a ? &*a : nullptr;
    views.entropy = h ? &*h : nullptr;
  }
  Extras(const Extras&) = delete;
  Extras& operator=(const Extras&) = delete;

  std::optional<vpce::TensorView> w, a, h;
  vpce::ForwardExtras views;
};

// The forward's collective through a Python callable (or a copy, for a single rank).
class CallbackCommunicator final : public vpce::Communicator {
 public:
  CallbackCommunicator(int rank, int size, nb::object all_gather)
      : rank_(rank), size_(size), all_gather_(std::move(all_gather)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "python"; }

  vpce::Status all_gather(const void* send, void* recv, std::size_t bytes) override {
    if (all_gather_.is_none()) {  // one rank: the gather is a copy
      if (bytes > 0) std::memcpy(recv, send, bytes);
      return {};
    }
    nb::gil_scoped_acquire gil;
    try {
      const auto size = static_cast<Py_ssize_t>(bytes);
      nb::object send_view = nb::steal(PyMemoryView_FromMemory(static_cast<char*>(const_cast<void*>(send)), size, PyBUF_WRITE));
      nb::object recv_view = nb::steal(PyMemoryView_FromMemory(static_cast<char*>(recv), size * size_, PyBUF_WRITE));
      all_gather_(send_view, recv_view);
      return {};
    } catch (nb::python_error& e) {
      return {vpce::Code::kRemoteError, std::string("all_gather: the Python collective raised: ") + e.what()};
    }
  }

 private:
  int rank_;
  int size_;
  nb::object all_gather_;
};

vpce::VocabShard shard_of(int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size) {
  return {vocab_begin, vocab_end, vocab_size};
}

}  // namespace

NB_MODULE(_vpce, m) {
  m.doc() = "vpce: exact vocab-parallel cross-entropy (C++ kernels over DLPack tensors)";
  m.attr("__version__") = VPCE_VERSION_STRING;
  nb::exception<StatusError>(m, "Error", PyExc_RuntimeError);

  nb::enum_<vpce::Reduction>(m, "Reduction")
      .value("NONE", vpce::Reduction::kNone)
      .value("SUM", vpce::Reduction::kSum)
      .value("MEAN", vpce::Reduction::kMean);
  nb::enum_<vpce::SmoothingSemantics>(m, "SmoothingSemantics")
      .value("MEGATRON", vpce::SmoothingSemantics::kMegatron)
      .value("PYTORCH", vpce::SmoothingSemantics::kPyTorch);

  nb::class_<vpce::LossOptions>(m, "LossOptions", "Every loss option; see include/vpce/loss.h")
      .def(nb::init<>())
      .def_rw("label_smoothing", &vpce::LossOptions::label_smoothing)
      .def_rw("smoothing_semantics", &vpce::LossOptions::smoothing_semantics)
      .def_rw("ignore_index", &vpce::LossOptions::ignore_index)
      .def_rw("z_loss_weight", &vpce::LossOptions::z_loss_weight)
      .def_rw("logit_scale", &vpce::LossOptions::logit_scale)
      .def_rw("softcap", &vpce::LossOptions::softcap)
      .def_rw("valid_vocab_size", &vpce::LossOptions::valid_vocab_size)
      .def_rw("reduction", &vpce::LossOptions::reduction)
      .def_rw("num_threads", &vpce::LossOptions::num_threads);

  // A hint for a new CPU buffer, before anything is written to it: back the 2 MiB-aligned
  // part of [address, address + bytes) with transparent huge pages, so that first touching
  // it costs one page fault per 2 MiB instead of one per 4 KiB. Linux only; returns whether
  // the kernel took the hint (it declines where THP is disabled).
  m.def(
      "advise_huge_pages",
      [](std::uintptr_t address, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
        const std::uintptr_t begin = (address + kHuge - 1) & ~(kHuge - 1);
        const std::uintptr_t end = (address + bytes) & ~(kHuge - 1);
        if (end <= begin) return false;
        return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
#else
        (void)address;
        (void)bytes;
        return false;
#endif
      },
      nb::arg("address"), nb::arg("bytes"));

  m.attr("STATS_WIDTH") = vpce::kStatsWidth;
  m.attr("STATS_WIDTH_WITH_EXTRAS") = vpce::kStatsWidthWithExtras;

  m.def(
      "forward",
      [](const Array& logits, const Array& targets, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, const MutableArray& loss, const MutableArray& lse,
         const std::optional<Array>& weights, const std::optional<MutableArray>& target_is_argmax,
         const std::optional<MutableArray>& entropy, int rank, int size, nb::object all_gather) {
        if (size > 1 && all_gather.is_none()) {
          throw StatusError("invalid argument: all_gather: expected a callable for a group of " +
                            std::to_string(size) + " ranks, got None");
        }
        const vpce::TensorView x = view(logits, "logits");
        const vpce::TensorView y = view(targets, "targets");
        const vpce::TensorView l = view(loss, "loss");
        const vpce::TensorView e = view(lse, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        CallbackCommunicator comm(rank, size, std::move(all_gather));
        vpce::Status status;
        {
          nb::gil_scoped_release release;
          status = vpce::forward(comm, x, y, shard_of(vocab_begin, vocab_end, vocab_size), options, l, e, extras.views);
        }
        check(status);
      },
      nb::arg("logits"), nb::arg("targets"), nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"),
      nb::arg("options"), nb::arg("loss"), nb::arg("lse"), nb::arg("weights") = nb::none(),
      nb::arg("target_is_argmax") = nb::none(), nb::arg("entropy") = nb::none(), nb::arg("rank") = 0,
      nb::arg("size") = 1, nb::arg("all_gather") = nb::none(),
      "One-call forward: local statistics, one all_gather(send, recv) through the callable, merge, loss.");

  m.def(
      "backward",
      [](const Array& logits, const Array& targets, const Array& lse, const Array& grad_loss, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, const MutableArray& grad_logits,
         const std::optional<Array>& weights) {
        const vpce::TensorView x = view(logits, "logits");
        const vpce::TensorView y = view(targets, "targets");
        const vpce::TensorView e = view(lse, "lse");
        const vpce::TensorView g = view(grad_loss, "grad_loss");
        const vpce::TensorView out = view(grad_logits, "grad_logits");
        const auto w = optional_view(weights, "weights");
        nb::gil_scoped_release release;
        check(vpce::backward(x, y, e, g, shard_of(vocab_begin, vocab_end, vocab_size), options, out, w ? &*w : nullptr));
      },
      nb::arg("logits"), nb::arg("targets"), nb::arg("lse"), nb::arg("grad_loss"), nb::arg("vocab_begin"),
      nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("grad_logits"),
      nb::arg("weights") = nb::none(), "Backward: no collective; grad_logits may be the logits themselves (in place).");

  m.def(
      "calculate_local_stats",
      [](const Array& logits, const Array& targets, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, const MutableArray& stats) {
        const vpce::TensorView x = view(logits, "logits");
        const vpce::TensorView y = view(targets, "targets");
        const vpce::TensorView s = view(stats, "stats");
        nb::gil_scoped_release release;
        check(vpce::calculate_local_stats(x, y, shard_of(vocab_begin, vocab_end, vocab_size), options, s));
      },
      nb::arg("logits"), nb::arg("targets"), nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"),
      nb::arg("options"), nb::arg("stats"), "Staged 1: this rank's [N, 4] (or [N, 6]) float32 statistics.");

  m.def(
      "merge_stats",
      [](const Array& gathered, const vpce::LossOptions& options, const MutableArray& stats) {
        const vpce::TensorView g = view(gathered, "gathered");
        const vpce::TensorView s = view(stats, "stats");
        nb::gil_scoped_release release;
        check(vpce::merge_stats(g, options, s));
      },
      nb::arg("gathered"), nb::arg("options"), nb::arg("stats"), "Staged 2: [R, N, W] -> [N, W], in rank order.");

  m.def(
      "calculate_loss",
      [](const Array& stats, const Array& targets, int64_t vocab_size, const vpce::LossOptions& options,
         const MutableArray& loss, const MutableArray& lse, const std::optional<Array>& weights,
         const std::optional<MutableArray>& target_is_argmax, const std::optional<MutableArray>& entropy) {
        const vpce::TensorView s = view(stats, "stats");
        const vpce::TensorView y = view(targets, "targets");
        const vpce::TensorView l = view(loss, "loss");
        const vpce::TensorView e = view(lse, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        nb::gil_scoped_release release;
        check(vpce::calculate_loss(s, y, vocab_size, options, l, e, extras.views));
      },
      nb::arg("stats"), nb::arg("targets"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("loss"),
      nb::arg("lse"), nb::arg("weights") = nb::none(), nb::arg("target_is_argmax") = nb::none(),
      nb::arg("entropy") = nb::none(), "Staged 3: merged statistics -> loss, lse and the extras.");
}
