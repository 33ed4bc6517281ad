// The one nanobind module, tensorfold._ext. Each op registers itself from its own file.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <string>

#include "layer_queue.h"
#include "row_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "TensorFold native core: LayerQueue and row-exact kernels (CPU faces).";

  // std::hash of a string, as MLX's CUDA backend names a custom kernel's module with it (both call
  // libstdc++'s _Hash_bytes): tensorfold.kernels._kcache finds MLX's cache entries by it
  m.def("std_hash", [](nb::bytes b) {
        return static_cast<uint64_t>(std::hash<std::string>{}(std::string(b.c_str(), b.size())));
      }, "data"_a, "std::hash<std::string> of the bytes (the C++ runtime's own).");

  nb::class_<tensorfold::LayerQueue>(m, "LayerQueue",
      "Starts each pushed layer's outputs evaluating asynchronously and blocks on the oldest "
      "once more than `depth` layers are in flight.")
      .def(nb::init<int>(), "depth"_a)
      .def("push", [](tensorfold::LayerQueue& q, std::vector<mlx::core::array> outs) {
            nb::gil_scoped_release release;
            q.push(std::move(outs));
          }, "outputs"_a)
      .def("drain", [](tensorfold::LayerQueue& q) {
            nb::gil_scoped_release release;
            q.drain();
          })
      .def_prop_ro("depth", &tensorfold::LayerQueue::depth)
      .def_prop_ro("in_flight", &tensorfold::LayerQueue::in_flight)
      .def_prop_ro("max_in_flight", &tensorfold::LayerQueue::max_in_flight)
      .def_prop_ro("pushed", &tensorfold::LayerQueue::pushed);

  tensorfold::register_row_ops(m);
}
