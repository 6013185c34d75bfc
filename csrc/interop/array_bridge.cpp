/* mlx_dualnorm._interop: mlx.core.array objects in and out of the C
 * composite, with no copy and no evaluation, and its errors out as Python
 * exceptions raised by the same call.
 *
 * cffi has no PyObject* type, so mx.array arguments cannot cross a cffi call.
 * This nanobind module, built in MLX's nanobind domain ("mlx", the same
 * nanobind ABI as mlx.core), sees mx.array objects as the mlx::core::array
 * they hold. It hands them to the composite as BORROWED mlx_array handles
 * whose ctx points into the Python objects (alive for the whole call, since
 * the caller and this frame hold references), and wraps the lazy outputs as
 * new mx.array objects. One Python-to-C crossing per call; the composite
 * itself is reached through the function pointer the cffi module exports
 * (bind), so the process has one epsilon slot and one trace lock.
 *
 * A failing call fills an mlx_dualnorm_error on this frame's stack, and the
 * exception is raised from it before control returns to Python: no
 * finalizer or other thread can run in between and touch the report.
 */
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/array.h"

#include "mlx_dualnorm/dual_head_norm.h"
#include "mlx_dualnorm/dual_head_norm_rope.h"
#include "mlx_dualnorm/dual_head_norm_rope_cache.h"
#include "private/position_scalar.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

/* The composites' labels (dual_head_norm.c, dual_head_norm_rope.c). */
const char APPLY_DUAL_HEAD_NORM_OPERATION[] = "dual_head_norm";
const char APPLY_DUAL_HEAD_NORM_ROPE_OPERATION[] = "dual_head_norm_rope";
const char APPLY_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION[] = "dual_head_norm_rope_with_cache";

/* What bind() received. The composite's functions live in the cffi module
 * (this module links no mlx-c), so the handles it creates are freed by the
 * same implementation that made them. The Python objects are kept for the
 * life of the process: one reference each, never released, so nothing here
 * runs Python code during interpreter teardown. */
struct BoundFunctions {
  decltype(&mlx_dualnorm_compiled_dual_head_norm_apply) apply = nullptr;
  decltype(&mlx_vector_array_free) free_vector = nullptr;
  nb::handle convert_array;    // (value, argument_name, operation) -> mx.array, or raises
  nb::handle value_error_type; // bad input or a closed object
  nb::handle mlx_error_type;   // MLX failed
  PyTypeObject* array_type = nullptr; // mlx.core.array, for the exact-type check
};
BoundFunctions bound;

/* What bind_rope() received, for the dual head norm + RoPE: its apply, the
 * one holder of positions' int32 scalars (private/position_scalar.h) and
 * mlx_array_free for the handles it gives, all exported by the cffi module,
 * and the facade's converters, whose messages name that operation. Kept
 * for the life of the process, as `bound`. */
struct BoundRopeFunctions {
  decltype(&mlx_dualnorm_dual_head_norm_rope_apply_with_freqs) apply = nullptr;
  decltype(&dualnorm_position_scalar) position_scalar = nullptr;
  decltype(&mlx_array_free) free_array = nullptr;
  nb::handle convert_array;  // (value, argument_name, operation) -> mx.array, or raises
  nb::handle convert_offset; // (value, operation) -> mx.array, or raises
  /* The norm + RoPE with the cache write (bind_rope_cache), or null. */
  decltype(&mlx_dualnorm_dual_head_norm_rope_apply_with_cache) apply_with_cache = nullptr;
};
BoundRopeFunctions bound_rope;

/* Whether `object` is an mx.array: its exact type first (a pointer
 * comparison, the decode path's case), then nanobind's check, which also
 * takes subclasses. Runs for every argument of every call. */
bool is_mx_array(nb::handle object) {
  return Py_TYPE(object.ptr()) == bound.array_type || nb::isinstance<mx::array>(object);
}

/* The output vector handle, freed on every path out of apply. */
struct OwnedOutputVector {
  mlx_vector_array vector{nullptr};
  ~OwnedOutputVector() {
    bound.free_vector(vector);
  }
};

[[noreturn]] void raise_type_error(const std::string& message,
                                   const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION) {
  throw nb::type_error((std::string("[") + operation + "] " + message).c_str());
}

/* A borrowed handle onto the array inside `object`, never freed here; an
 * empty handle for None where `optional`. Anything but an mx.array goes
 * through the facade's converter (`convert_array`, or bind()'s) (numpy arrays, clear TypeErrors), whose
 * result `converted` keeps alive for the call. An mx.array whose __init__
 * never ran holds no array: reading it would crash, so it is refused. */
mlx_array borrow_array(nb::handle object, const char* argument_name, bool optional,
                       nb::object& converted,
                       const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION,
                       nb::handle convert_array = nb::handle()) {
  if (optional && object.is_none()) {
    return mlx_array{nullptr};
  }
  if (!is_mx_array(object)) {
    nb::handle converter = convert_array.is_valid() ? convert_array : bound.convert_array;
    converted = converter(object, argument_name, operation);
    object = converted;
    if (!is_mx_array(object)) {
      raise_type_error(
          std::string("the converter returned no mlx.core.array for ") + argument_name,
          operation);
    }
  }
  if (!nb::inst_ready(object)) {
    raise_type_error(std::string(argument_name) +
                         " is an mlx.core.array that was never initialized (its __init__ "
                         "did not run)",
                     operation);
  }
  return mlx_array{nb::inst_ptr<mx::array>(object)};
}

/* A Python int (not a bool) as a position, where an int32 holds it:
 * MLX's positions are int32, as mx.fast.rope makes an int offset. */
std::optional<int32_t> int32_position(nb::handle object) {
  if (!PyLong_CheckExact(object.ptr())) {
    return std::nullopt;
  }
  int overflow = 0;
  long long value = PyLong_AsLongLongAndOverflow(object.ptr(), &overflow);
  if (overflow != 0 || value < INT32_MIN || value > INT32_MAX) {
    return std::nullopt;
  }
  return static_cast<int32_t>(value);
}

/* A position's int32 scalar for one call: a handle of the cffi module's
 * (made by position_scalar, freed by its mlx_array_free when the call is
 * over), onto the one scalar held per position. */
struct OwnedPositionScalar {
  mlx_array handle{nullptr};
  OwnedPositionScalar() = default;
  OwnedPositionScalar(const OwnedPositionScalar&) = delete;
  OwnedPositionScalar& operator=(const OwnedPositionScalar&) = delete;
  ~OwnedPositionScalar() {
    if (handle.ctx != nullptr) {
      bound_rope.free_array(handle);
    }
  }
};

[[noreturn]] void raise_dual_head_norm_error(const mlx_dualnorm_error& error);

/* The RoPE offset as a borrowed handle. A Python int within int32 becomes
 * the int32 scalar of that position (`position`, which owns the handle for
 * the call): what mx.fast.rope makes of such an int, without a Python
 * object on the decode path, and the very array the KV-cache write's row
 * is when it is the same number. Anything else is what mx.fast.rope turns
 * into an array: an mx.array as is, other values through the facade's
 * offset converter. */
mlx_array borrow_offset(nb::handle object, nb::object& converted, OwnedPositionScalar& position,
                        const char* operation) {
  if (std::optional<int32_t> value = int32_position(object)) {
    if (bound_rope.position_scalar(&position.handle, *value) != 0) {
      mlx_dualnorm_error error{MLX_DUALNORM_MLX_FAILURE, operation, {}};
      std::snprintf(error.description, sizeof error.description,
                    "the int32 scalar of offset %d could not be made", *value);
      raise_dual_head_norm_error(error);
    }
    return position.handle;
  }
  if (!is_mx_array(object)) {
    converted = bound_rope.convert_offset(object, operation);
    object = converted;
  }
  return borrow_array(object, "offset", false, converted, operation, bound_rope.convert_array);
}

[[noreturn]] void raise_dual_head_norm_error(const mlx_dualnorm_error& error) {
  bool bad_input =
      error.status == MLX_DUALNORM_INVALID_ARGUMENT || error.status == MLX_DUALNORM_CLOSED;
  nb::handle error_type = bad_input ? bound.value_error_type : bound.mlx_error_type;
  // A description cut at its capacity may end inside a UTF-8 sequence.
  nb::object description = nb::steal(PyUnicode_DecodeUTF8(
      error.description, static_cast<Py_ssize_t>(std::strlen(error.description)), "replace"));
  if (!description.is_valid()) {
    throw nb::python_error();
  }
  nb::object exception = error_type(nb::str(error.operation ? error.operation : ""),
                                    description);
  PyErr_SetObject(error_type.ptr(), exception.ptr());
  throw nb::python_error();
}

/* The arrays of a successful call's output vector, moved out (still lazy)
 * into new mx.array objects, in order. mlx-c's vector handle owns a
 * std::vector<mlx::core::array> (the one layout fact this bridge relies on,
 * shared by the subset and upstream). */
nb::tuple outputs_as_tuple(OwnedOutputVector& outputs) {
  auto& output_arrays = *static_cast<std::vector<mx::array>*>(outputs.vector.ctx);
  nb::object graph_outputs = nb::steal(PyTuple_New(output_arrays.size()));
  if (!graph_outputs.is_valid()) {
    throw nb::python_error();
  }
  for (size_t index = 0; index < output_arrays.size(); ++index) {
    nb::object output = nb::cast(std::move(output_arrays[index]), nb::rv_policy::move);
    // The stable ABI's setter (the macro reads the tuple's layout); it
    // steals the reference.
    if (PyTuple_SetItem(graph_outputs.ptr(), static_cast<Py_ssize_t>(index),
                        output.release().ptr()) != 0) {
      throw nb::python_error();
    }
  }
  return nb::borrow<nb::tuple>(graph_outputs);
}

/* Returns a tuple of every array the composite produced (the facade checks
 * there are exactly two and unpacks them in order), or raises the
 * composite's error. */
nb::tuple apply(std::uintptr_t dual_head_norm_address, nb::handle queries, nb::handle keys,
                nb::handle query_scale_weight, nb::handle key_scale_weight) {
  if (bound.apply == nullptr) {
    throw std::runtime_error("mlx_dualnorm._interop.bind was never called");
  }
  nb::object converted[4];
  mlx_array borrowed_queries = borrow_array(queries, "queries", false, converted[0]);
  mlx_array borrowed_keys = borrow_array(keys, "keys", false, converted[1]);
  mlx_array borrowed_query_weight =
      borrow_array(query_scale_weight, "query_weight", true, converted[2]);
  mlx_array borrowed_key_weight =
      borrow_array(key_scale_weight, "key_weight", true, converted[3]);

  OwnedOutputVector outputs;
  mlx_dualnorm_error error{};
  int status = bound.apply(
      &outputs.vector,
      reinterpret_cast<mlx_dualnorm_compiled_dual_head_norm*>(dual_head_norm_address),
      borrowed_queries, borrowed_keys, borrowed_query_weight, borrowed_key_weight, &error);
  if (status != MLX_DUALNORM_OK) {
    raise_dual_head_norm_error(error);
  }
  return outputs_as_tuple(outputs);
}

/* The norm + RoPE's arguments as borrowed handles, and the converted
 * objects that keep them alive for the call. */
struct BorrowedDualHeadNormRope {
  nb::object converted[6];
  OwnedPositionScalar offset_position;
  mlx_array queries, keys, query_weight, key_weight, offset, freqs;

  BorrowedDualHeadNormRope(nb::handle queries_object, nb::handle keys_object,
                           nb::handle query_weight_object, nb::handle key_weight_object,
                           nb::handle offset_object, nb::handle freqs_object,
                           const char* operation) {
    nb::handle convert = bound_rope.convert_array;
    queries = borrow_array(queries_object, "queries", false, converted[0], operation, convert);
    keys = borrow_array(keys_object, "keys", false, converted[1], operation, convert);
    query_weight = borrow_array(query_weight_object, "query_weight", true, converted[2],
                                operation, convert);
    key_weight =
        borrow_array(key_weight_object, "key_weight", true, converted[3], operation, convert);
    offset = borrow_offset(offset_object, converted[4], offset_position, operation);
    freqs = borrow_array(freqs_object, "freqs", true, converted[5], operation, convert);
  }
};

/* The dual head norm + RoPE, as apply, with the offset: an int, or what
 * mx.fast.rope takes as an array; and the frequency table: None (an empty
 * handle) or an mx.array, as mx.fast.rope takes it (the facade refuses
 * anything else before this call). */
nb::tuple apply_rope(std::uintptr_t norm_rope_address, nb::handle queries, nb::handle keys,
                     nb::handle query_scale_weight, nb::handle key_scale_weight,
                     nb::handle offset, nb::handle freqs) {
  if (bound_rope.apply == nullptr || bound.free_vector == nullptr) {
    throw std::runtime_error("mlx_dualnorm._interop.bind and bind_rope were not both called");
  }
  BorrowedDualHeadNormRope borrowed(queries, keys, query_scale_weight, key_scale_weight, offset,
                                    freqs, APPLY_DUAL_HEAD_NORM_ROPE_OPERATION);

  OwnedOutputVector outputs;
  mlx_dualnorm_error error{};
  int status = bound_rope.apply(
      &outputs.vector, reinterpret_cast<mlx_dualnorm_dual_head_norm_rope*>(norm_rope_address),
      borrowed.queries, borrowed.keys, borrowed.query_weight, borrowed.key_weight,
      borrowed.offset, borrowed.freqs, &error);
  if (status != MLX_DUALNORM_OK) {
    raise_dual_head_norm_error(error);
  }
  return outputs_as_tuple(outputs);
}

/* The norm + RoPE with the KV-cache write: as apply_rope, plus values, the
 * two cache buffers (borrowed, as every array), the write row, a Python
 * int (the facade's type check), and `fetch`. The row becomes the C int
 * here, the one conversion it has: one no int32 holds names no row of any
 * MLX buffer, so it is refused as outside them; every other row's range is
 * the composite's check alone. Returns the composite's outputs (queries,
 * key buffer, value buffer, and with `fetch` the key and value rows
 * fetched) as a tuple, or raises. */
nb::tuple apply_rope_with_cache(std::uintptr_t norm_rope_address, nb::handle queries,
                                nb::handle keys, nb::handle values,
                                nb::handle query_scale_weight, nb::handle key_scale_weight,
                                nb::handle offset, nb::handle freqs, nb::handle key_cache,
                                nb::handle value_cache, nb::handle write_offset, bool fetch) {
  if (bound_rope.apply_with_cache == nullptr || bound.free_vector == nullptr) {
    throw std::runtime_error(
        "mlx_dualnorm._interop.bind and bind_rope_cache were not both called");
  }
  const char* operation = APPLY_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION;
  std::optional<int32_t> write_row = int32_position(write_offset);
  if (!write_row) {
    std::string row = nb::str(write_offset).c_str();
    mlx_dualnorm_error error{MLX_DUALNORM_INVALID_ARGUMENT, operation, {}};
    std::snprintf(error.description, sizeof error.description,
                  "write_offset %s is outside the buffers", row.c_str());
    raise_dual_head_norm_error(error);
  }
  nb::handle convert = bound_rope.convert_array;
  BorrowedDualHeadNormRope borrowed(queries, keys, query_scale_weight, key_scale_weight, offset,
                                    freqs, operation);
  nb::object converted[3];
  mlx_array borrowed_values =
      borrow_array(values, "values", false, converted[0], operation, convert);
  mlx_array borrowed_key_cache =
      borrow_array(key_cache, "key_cache", false, converted[1], operation, convert);
  mlx_array borrowed_value_cache =
      borrow_array(value_cache, "value_cache", false, converted[2], operation, convert);

  OwnedOutputVector outputs;
  mlx_dualnorm_error error{};
  int status = bound_rope.apply_with_cache(
      &outputs.vector, reinterpret_cast<mlx_dualnorm_dual_head_norm_rope*>(norm_rope_address),
      borrowed.queries, borrowed.keys, borrowed_values, borrowed.query_weight,
      borrowed.key_weight, borrowed.offset, borrowed.freqs, borrowed_key_cache,
      borrowed_value_cache, *write_row, fetch, &error);
  if (status != MLX_DUALNORM_OK) {
    raise_dual_head_norm_error(error);
  }
  return outputs_as_tuple(outputs);
}

void bind(std::uintptr_t apply_function_address, std::uintptr_t free_vector_function_address,
          nb::callable convert_array, nb::type_object value_error_type,
          nb::type_object mlx_error_type) {
  bound.apply =
      reinterpret_cast<decltype(bound.apply)>(apply_function_address);
  bound.free_vector = reinterpret_cast<decltype(bound.free_vector)>(free_vector_function_address);
  bound.convert_array = convert_array.release();
  bound.value_error_type = value_error_type.release();
  bound.mlx_error_type = mlx_error_type.release();
  bound.array_type = reinterpret_cast<PyTypeObject*>(nb::type<mx::array>().ptr());
}

void bind_rope(std::uintptr_t apply_function_address, std::uintptr_t position_scalar_address,
               std::uintptr_t free_array_address, nb::callable convert_array,
               nb::callable convert_offset) {
  bound_rope.apply = reinterpret_cast<decltype(bound_rope.apply)>(apply_function_address);
  bound_rope.position_scalar =
      reinterpret_cast<decltype(bound_rope.position_scalar)>(position_scalar_address);
  bound_rope.free_array = reinterpret_cast<decltype(bound_rope.free_array)>(free_array_address);
  bound_rope.convert_array = convert_array.release();
  bound_rope.convert_offset = convert_offset.release();
}

void bind_rope_cache(std::uintptr_t apply_with_cache_function_address) {
  bound_rope.apply_with_cache =
      reinterpret_cast<decltype(bound_rope.apply_with_cache)>(apply_with_cache_function_address);
}

/* Makes the Python mx.array object `target` hold `source`'s array, as MLX's
 * item assignment (`target[...] = value`) does with the slice update it
 * builds: the object keeps its identity, so every holder of it (a cache, a
 * state snapshot, a copy of the cache sharing its arrays) sees the new
 * contents, and the old array stays alive only as long as a graph node
 * still reads it. Both arguments are BORROWED; nothing is evaluated. */
void assign(mx::array& target, const mx::array& source) {
  target.overwrite_descriptor(source);
}

} // namespace

NB_MODULE(_interop, module) {
  module.doc() = "mx.array <-> mlx_array bridge for the compiled dual head norm.";
  module.def("bind", &bind, nb::arg("apply_function_address"),
      nb::arg("free_vector_function_address"), nb::arg("convert_array"),
      nb::arg("value_error_type"), nb::arg("mlx_error_type"),
      "Binds the composite's apply and mlx_vector_array_free (exported by the cffi "
      "module), the converter for non-mx.array arguments and the exception types.");
  module.def("apply", &apply, nb::arg("dual_head_norm_address"), nb::arg("queries").none(),
      nb::arg("keys").none(), nb::arg("query_weight").none(), nb::arg("key_weight").none(),
      "Applies the compiled dual head norm: a tuple of its outputs, or the error raised.");
  module.def("bind_rope", &bind_rope, nb::arg("apply_function_address"),
      nb::arg("position_scalar_function_address"), nb::arg("free_array_function_address"),
      nb::arg("convert_array"), nb::arg("convert_offset"),
      "Binds the dual head norm rope's apply_with_freqs, the holder of positions' int32 "
      "scalars and mlx_array_free (exported by the cffi module) and its converters for "
      "non-mx.array arguments and offsets; bind() must be called too.");
  module.def("apply_rope", &apply_rope, nb::arg("norm_rope_address"),
      nb::arg("queries").none(), nb::arg("keys").none(), nb::arg("query_weight").none(),
      nb::arg("key_weight").none(), nb::arg("offset").none(),
      nb::arg("freqs").none() = nb::none(),
      "Applies the compiled dual head norm rope: a tuple of its outputs, or the error "
      "raised.");
  module.def("assign", &assign, nb::arg("target"), nb::arg("source"),
      "Makes the array object target hold source's array, as item assignment does.");
  module.def("bind_rope_cache", &bind_rope_cache, nb::arg("apply_with_cache_function_address"),
      "Binds the dual head norm rope's apply_with_cache (exported by the cffi module); "
      "bind() and bind_rope() must be called too.");
  module.def("apply_rope_with_cache", &apply_rope_with_cache, nb::arg("norm_rope_address"),
      nb::arg("queries").none(), nb::arg("keys").none(), nb::arg("values").none(),
      nb::arg("query_weight").none(), nb::arg("key_weight").none(), nb::arg("offset").none(),
      nb::arg("freqs").none(), nb::arg("key_cache").none(), nb::arg("value_cache").none(),
      nb::arg("write_offset").none(), nb::arg("fetch") = false,
      "Applies the dual head norm rope with the KV-cache write: a tuple of its outputs "
      "(queries, key buffer, value buffer, and with fetch the rows fetched), or the error "
      "raised.");
}
