// bindings/python/src/rows_bindings.cc: the row kernels for Megatron's static helpers
// (vpce/rows.h).
#include <nanobind/nanobind.h>

#include <array>

#include "arguments.h"

namespace vpce::python {

namespace {

// A row kernel of vpce/rows.h, kernel(first, second, third or null, num_threads), bound with
// its arguments' names (the third optional) and its docstring.
template <class First, class Second, class Kernel>
void def_row_kernel(nb::module_& m, const char* name, std::array<const char*, 3> names, Kernel kernel,
                    const char* doc) {
  m.def(
      name,
      [names, kernel](nb::handle a, nb::handle b, nb::handle c, int num_threads) {
        const First first(a, names[0]);
        const Second second(b, names[1]);
        const OptionalOutput third(c, names[2]);
        released([&] { return kernel(first, second, third.get(), num_threads); });
      },
      nb::arg(names[0]).none(), nb::arg(names[1]).none(), nb::arg(names[2]).none() = nb::none(),
      nb::arg("num_threads") = 0, doc);
}

}  // namespace

void bind_rows(nb::module_& m) {
  // Row kernels for Megatron's static helpers (vpce/rows.h): CPU arrays [..., K] whose leading
  // dimensions collapse to one row stride, the last dimension contiguous.
  def_row_kernel<Input, Output>(m, "row_max", {"logits", "max", "widened"}, &vpce::row_max,
                                "max[...] <- each row's max of logits [..., K] (NaN-propagating); widened, when "
                                "given, <- the logits as float32, in the same read.");
  def_row_kernel<Output, Input>(m, "exp_rows_in_place", {"x", "shift", "sums"}, &vpce::exp_rows_in_place,
                                "x[i, v] <- exp(x[i, v] - shift[i]) in place (float32); sums, when given, <- each "
                                "row's sum of the new x.");
}

}  // namespace vpce::python
