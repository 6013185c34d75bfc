/* mlx_dualnorm._interop: mlx.core.array objects in and out of the C
 * composite, with no copy and no evaluation.
 *
 * cffi has no PyObject* type, so mx.array arguments cannot cross a cffi call.
 * This nanobind module, built in MLX's nanobind domain ("mlx", the same
 * nanobind ABI as mlx.core), sees mx.array objects as the mlx::core::array
 * they hold. It hands them to the composite as BORROWED mlx_array handles
 * whose ctx points into the Python objects (alive for the whole call, since
 * the caller holds references), and wraps the two lazy outputs as new
 * mx.array objects. One Python-to-C crossing per call; the composite itself
 * is reached through the function pointer the cffi module exports (bind),
 * so the process has one epsilon slot, one trace lock, one error record.
 */
#include <cstdint>
#include <memory>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/array.h"

#include "dual_head_norm.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

const char APPLY_DUAL_HEAD_NORM_OPERATION[] = "apply the compiled MLX dual head norm";

/* Both live in the cffi module (this module links no mlx-c): the handles
 * it creates are freed by the same implementation that made them. */
using ApplyCompiledDualHeadNorm = decltype(&mlx_dualnorm_apply_compiled_dual_head_norm);
using FreeVectorArray = decltype(&mlx_vector_array_free);
ApplyCompiledDualHeadNorm apply_compiled_dual_head_norm = nullptr;
FreeVectorArray free_vector_array = nullptr;

/* The output vector handle, freed on every path out of apply. */
struct OwnedOutputVector {
  mlx_vector_array vector{nullptr};
  ~OwnedOutputVector() {
    free_vector_array(vector);
  }
};

/* A borrowed handle onto the array inside `object` (never freed here); an
 * empty handle for None where `optional`. */
mlx_array borrow_array(nb::handle object, const char* argument_name, bool optional) {
  if (optional && object.is_none()) {
    return mlx_array{nullptr};
  }
  if (!nb::isinstance<mx::array>(object)) {
    throw nb::type_error(
        (std::string("[") + APPLY_DUAL_HEAD_NORM_OPERATION + "] " + argument_name +
         " must be an mlx.core.array" + (optional ? " or None" : "") + ", not " +
         nb::type_name(object.type()).c_str())
            .c_str());
  }
  return mlx_array{nb::inst_ptr<mx::array>(object)};
}

/* Returns a tuple of every array the composite produced (the facade checks
 * there are exactly two and unpacks them in order), or None when the
 * composite failed; its thread-local error record then says why. */
nb::object apply(
    std::uintptr_t dual_head_norm_address,
    nb::handle queries,
    nb::handle keys,
    nb::handle query_scale_weight,
    nb::handle key_scale_weight) {
  if (apply_compiled_dual_head_norm == nullptr || free_vector_array == nullptr) {
    throw std::runtime_error("mlx_dualnorm._interop.bind was never called");
  }
  mlx_array borrowed_queries = borrow_array(queries, "queries", false);
  mlx_array borrowed_keys = borrow_array(keys, "keys", false);
  mlx_array borrowed_query_weight = borrow_array(query_scale_weight, "query_weight", true);
  mlx_array borrowed_key_weight = borrow_array(key_scale_weight, "key_weight", true);

  OwnedOutputVector outputs;
  int status = apply_compiled_dual_head_norm(
      &outputs.vector,
      reinterpret_cast<mlx_dualnorm_compiled_dual_head_norm*>(dual_head_norm_address),
      borrowed_queries, borrowed_keys, borrowed_query_weight, borrowed_key_weight);
  if (status != MLX_DUALNORM_OK) {
    return nb::none();
  }
  /* mlx-c's vector handle owns a std::vector<mlx::core::array> (the one
   * layout fact this bridge relies on); the arrays are moved out, lazily. */
  auto& output_arrays = *static_cast<std::vector<mx::array>*>(outputs.vector.ctx);
  nb::object graph_outputs = nb::steal(PyTuple_New(output_arrays.size()));
  if (!graph_outputs.is_valid()) {
    throw nb::python_error();
  }
  for (size_t index = 0; index < output_arrays.size(); ++index) {
    nb::object output = nb::cast(std::move(output_arrays[index]), nb::rv_policy::move);
    PyTuple_SET_ITEM(graph_outputs.ptr(), index, output.release().ptr());
  }
  return graph_outputs;
}

void bind(std::uintptr_t apply_function_address, std::uintptr_t free_vector_function_address) {
  apply_compiled_dual_head_norm =
      reinterpret_cast<ApplyCompiledDualHeadNorm>(apply_function_address);
  free_vector_array = reinterpret_cast<FreeVectorArray>(free_vector_function_address);
}

} // namespace

NB_MODULE(_interop, module) {
  module.doc() = "mx.array <-> mlx_array bridge for the compiled dual head norm.";
  module.def("bind", &bind, nb::arg("apply_function_address"),
      nb::arg("free_vector_function_address"),
      "Binds the composite's apply and mlx_vector_array_free, exported by the cffi module.");
  module.def("apply", &apply, nb::arg("dual_head_norm_address"), nb::arg("queries"),
      nb::arg("keys"), nb::arg("query_weight").none(), nb::arg("key_weight").none(),
      "Applies the compiled dual head norm; a tuple of outputs, or None on failure.");
}
