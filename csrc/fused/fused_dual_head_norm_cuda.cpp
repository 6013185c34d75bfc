/* The fused backend tables of the dual head norm and of the dual head
 * norm + RoPE, in a build with MLX's CUDA backend: availability, one-time
 * kernel compilation with NVRTC, and the launch through the
 * FusedDualRmsNorm and FusedDualRmsNormRope primitives
 * (fused_dual_head_norm_primitive.cpp and
 * fused_dual_head_norm_rope_primitive.cpp).
 *
 * NVRTC is found in the process (MLX's CUDA backend links it) and compiles
 * the kernel once, for the GPU's own architecture, at the first
 * preparation. build_ffi.py compiles this file only where it compiles the
 * primitives; a build without MLX's CUDA headers compiles
 * fused_dual_head_norm_no_cuda.c instead, whose tables report the fused
 * mode unavailable.
 */
#include "fused/fused_dual_head_norm.h"

#include <dlfcn.h>

#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "mlx/device.h"

#include "fused/dual_head_norm_kernel.cuh"
#include "fused/dual_head_norm_rope_kernel.cuh"
#include "fused/fused_dual_head_norm_primitive.h"
#include "fused/fused_dual_head_norm_rope_primitive.h"
#include "fused/output_memory.h"

namespace {

namespace mx = mlx::core;

/* The labels of each kernel's errors, as MLX writes "[rms_norm] ...". */
const char kDualHeadNormOperation[] = "fused_dual_head_norm";
const char kDualHeadNormRopeOperation[] = "fused_dual_head_norm_rope";

/* The NVRTC entry points used, resolved with dlsym (nvrtcProgram is an
 * opaque pointer; nvrtcResult an int enum, 0 on success). */
struct NvrtcLibrary {
  using Program = void*;
  int (*create_program)(Program*, const char*, const char*, int, const char* const*,
                        const char* const*) = nullptr;
  int (*compile_program)(Program, int, const char* const*) = nullptr;
  int (*get_cubin_size)(Program, size_t*) = nullptr;
  int (*get_cubin)(Program, char*) = nullptr;
  int (*get_program_log_size)(Program, size_t*) = nullptr;
  int (*get_program_log)(Program, char*) = nullptr;
  int (*destroy_program)(Program*) = nullptr;
};

template <typename Function>
void resolve(void* library, const char* symbol, Function& function,
             const std::string& operation) {
  function = reinterpret_cast<Function>(dlsym(library, symbol));
  if (function == nullptr) {
    throw std::runtime_error("[" + operation + "] NVRTC lacks " + symbol);
  }
}

/* The handle stays open for the process: MLX's CUDA backend holds the same
 * library, and the compiled cubin outlives the compiler anyway. */
NvrtcLibrary open_nvrtc(const std::string& operation) {
  static const char* const candidates[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  void* library = nullptr;
  for (int flags : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW}) {
    for (const char* candidate : candidates) {
      if ((library = dlopen(candidate, flags)) != nullptr) {
        break;
      }
    }
    if (library != nullptr) {
      break;
    }
  }
  if (library == nullptr) {
    throw std::runtime_error(
        "[" + operation +
        "] NVRTC (libnvrtc.so) was not found; MLX's CUDA backend ships it as a dependency");
  }
  NvrtcLibrary nvrtc;
  resolve(library, "nvrtcCreateProgram", nvrtc.create_program, operation);
  resolve(library, "nvrtcCompileProgram", nvrtc.compile_program, operation);
  resolve(library, "nvrtcGetCUBINSize", nvrtc.get_cubin_size, operation);
  resolve(library, "nvrtcGetCUBIN", nvrtc.get_cubin, operation);
  resolve(library, "nvrtcGetProgramLogSize", nvrtc.get_program_log_size, operation);
  resolve(library, "nvrtcGetProgramLog", nvrtc.get_program_log, operation);
  resolve(library, "nvrtcDestroyProgram", nvrtc.destroy_program, operation);
  return nvrtc;
}

size_t device_info_number(const char* key, const std::string& operation) {
  const auto& info = mx::device_info(mx::Device::gpu);
  auto entry = info.find(key);
  if (entry == info.end() || !std::holds_alternative<size_t>(entry->second)) {
    throw std::runtime_error(
        "[" + operation + "] MLX reports no GPU " + key +
        "; the fused kernel needs the CUDA backend");
  }
  return std::get<size_t>(entry->second);
}

/* The cubin of `source` for this GPU's architecture; `operation` prefixes
 * the errors. The program is destroyed on every path. */
std::string compile_kernel_cubin(const std::string& source, const char* program_name,
                                 const std::string& operation) {
  NvrtcLibrary nvrtc = open_nvrtc(operation);
  std::string architecture = "--gpu-architecture=sm_" +
                             std::to_string(device_info_number("compute_capability_major", operation)) +
                             std::to_string(device_info_number("compute_capability_minor", operation));
  NvrtcLibrary::Program program = nullptr;
  if (nvrtc.create_program(&program, source.c_str(), program_name, 0, nullptr, nullptr) != 0) {
    throw std::runtime_error("[" + operation + "] nvrtcCreateProgram failed");
  }
  std::string cubin;
  std::string failure;
  const char* options[] = {architecture.c_str()};
  if (nvrtc.compile_program(program, 1, options) != 0) {
    size_t log_size = 0;
    std::string log;
    if (nvrtc.get_program_log_size(program, &log_size) == 0) {
      log.resize(log_size);
      if (nvrtc.get_program_log(program, log.data()) != 0) {
        log = "(no log)";
      }
    }
    failure = "[" + operation + "] NVRTC could not compile the kernel (" +
              architecture + "): " + log;
  } else {
    size_t cubin_size = 0;
    if (nvrtc.get_cubin_size(program, &cubin_size) != 0 || cubin_size == 0) {
      failure = "[" + operation + "] NVRTC produced no cubin for " + architecture;
    } else {
      cubin.resize(cubin_size);
      if (nvrtc.get_cubin(program, cubin.data()) != 0) {
        failure = "[" + operation + "] nvrtcGetCUBIN failed";
      }
    }
  }
  nvrtc.destroy_program(&program);
  if (!failure.empty()) {
    throw std::runtime_error(failure);
  }
  return cubin;
}

struct PreparedKernel {
  std::once_flag once;
  std::string failure;

  /* Throws `failure`, the reason the kernel cannot run, if there is one. */
  void require_ready() const {
    if (!failure.empty()) {
      throw std::runtime_error(failure);
    }
  }
};

/* Runs `compile_and_load` (compile a kernel, hand it to its primitive)
 * once per `kernel`; what it throws becomes `kernel.failure`. */
template <typename CompileAndLoad>
PreparedKernel& prepared_once(PreparedKernel& kernel, CompileAndLoad compile_and_load) {
  std::call_once(kernel.once, [&] {
    try {
      compile_and_load();
    } catch (const std::exception& e) {
      kernel.failure = e.what();
    }
  });
  return kernel;
}

/* A primitive's cubin loader (its set_*_cubin). */
using CubinLoader = void (*)(std::string);

constexpr CubinLoader kNormCubinLoader = &mlx_dualnorm_fused::set_kernel_cubin;
constexpr CubinLoader kRopeCubinLoader = &mlx_dualnorm_fused::set_rope_kernel_cubin;

/* Compiles a kernel's program (kRowNormalizationSource followed by its
 * `entry_source`) and hands the cubin to `load`, once per `kernel`;
 * `failure` says why not, `operation` labelling it. */
PreparedKernel& prepared_program(PreparedKernel& kernel, const char* entry_source,
                                 const char* program_name, const char* operation,
                                 CubinLoader load) {
  return prepared_once(kernel, [&] {
    load(compile_kernel_cubin(std::string(mlx_dualnorm_fused::kRowNormalizationSource) +
                                  entry_source,
                              program_name, operation));
  });
}

/* The dual norm's kernel, compiled and handed to its primitive once. */
PreparedKernel& prepared_kernel() {
  static PreparedKernel kernel;
  return prepared_program(kernel, mlx_dualnorm_fused::kDualHeadNormEntrySource,
                          "mlx_dualnorm_dual_head_norm.cu", kDualHeadNormOperation,
                          kNormCubinLoader);
}

/* The facts of mlx-c's handle layout this file relies on, as every mlx-c
 * does (the subset and upstream alike): an mlx_array's ctx is a heap
 * mlx::core::array the handle owns, and mlx_array_free deletes it; an
 * mlx_vector_array's ctx is a heap std::vector<mlx::core::array> (the
 * nanobind bridge relies on the same), created and freed by mlx-c. */
const mx::array& borrowed_array(const mlx_array handle) {
  return *static_cast<const mx::array*>(handle.ctx);
}

const mx::array* borrowed_weight_or_null(const mlx_array weight) {
  return static_cast<const mx::array*>(weight.ctx);
}

/* Runs `body`; 0 on success, 1 with the message sent to mlx-c's error
 * handler on any throw (no exception crosses the C boundary); `operation`
 * labels a throw that carries no message of its own. */
template <typename Body>
int report_failures(const char* operation, Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    mlx_error("%s", e.what());
  } catch (...) {
    mlx_error("[%s] unknown C++ exception", operation);
  }
  return 1;
}

bool fused_backend_available() {
  try {
    return mx::is_available(mx::Device::gpu) &&
           mx::device_info(mx::Device::gpu).count("compute_capability_major") > 0;
  } catch (const std::exception&) {
    return false;
  }
}

int prepare_fused_kernel() {
  return report_failures(kDualHeadNormOperation, [] {
    prepared_kernel().require_ready();
  });
}

/* Sets `*res` to the outputs, in order: mlx-c empties (or creates) the
 * vector, which stays mlx-c's to free, and takes the outputs' storage, the
 * arrays still lazy. No allocation, no handle per output and no
 * reference-count traffic: this runs on every fused call. */
int publish_outputs(mlx_vector_array* res, std::vector<mx::array>& outputs) {
  if (mlx_vector_array_set_data(res, nullptr, 0) != 0) {
    return 1;
  }
  *static_cast<std::vector<mx::array>*>(res->ctx) = std::move(outputs);
  return 0;
}

/* Runs `launch` (which returns a launch's lazy outputs) once `prepared`'s
 * kernel is ready, then publishes the outputs to `*res`; 0 on success, 1
 * with the reason sent to mlx-c's error handler (report_failures). */
template <typename Launch>
int launch_and_publish(mlx_vector_array* res, const char* operation,
                       PreparedKernel& (*prepared)(), Launch&& launch) {
  std::vector<mx::array> outputs;
  int status = report_failures(operation, [&] {
    prepared().require_ready();
    outputs = launch();
  });
  return status != 0 ? status : publish_outputs(res, outputs);
}

int apply_fused_kernel(mlx_vector_array* res, const mlx_array queries, const mlx_array keys,
                       const mlx_array query_scale_weight, const mlx_array key_scale_weight,
                       float rms_norm_epsilon) {
  return launch_and_publish(res, kDualHeadNormOperation, prepared_kernel, [&] {
    return mlx_dualnorm_fused::fused_dual_head_norm(
        borrowed_array(queries), borrowed_array(keys),
        borrowed_weight_or_null(query_scale_weight), borrowed_weight_or_null(key_scale_weight),
        rms_norm_epsilon);
  });
}

const mlx_dualnorm_fused_backend fused_backend = {
    {
        fused_backend_available,
        prepare_fused_kernel,
        MLX_DUALNORM_MAX_RANK,
        std::numeric_limits<int>::max(), // rows of any width
    },
    apply_fused_kernel,
};

/* ---- The fused dual head norm + RoPE ----------------------------------- */

/* The norm + RoPE kernels (their own program: the row normalization
 * source followed by the RoPE entry points, with and without the KV-cache
 * write), compiled and handed to their primitive once. */
PreparedKernel& prepared_rope_kernel() {
  static PreparedKernel kernel;
  return prepared_program(kernel, mlx_dualnorm_fused::kDualHeadNormRopeEntrySource,
                          "mlx_dualnorm_dual_head_norm_rope.cu", kDualHeadNormRopeOperation,
                          kRopeCubinLoader);
}

int prepare_fused_rope_kernel() {
  return report_failures(kDualHeadNormRopeOperation, [] {
    prepared_rope_kernel().require_ready();
  });
}

/* The RoPE constants as the primitive takes them (`normalizes` false: no
 * norms before the rotation). */
mlx_dualnorm_fused::RopeConstants rope_constants(const mlx_dualnorm_rope_parameters& rope,
                                                 bool normalizes) {
  return mlx_dualnorm_fused::RopeConstants{
      rope.dims,       rope.traditional, rope.base, rope.scale, rope.with_freqs,
      rope.input_scale.has_value, rope.input_scale.value, normalizes};
}

/* The table's `apply`: one norm + RoPE launch, with the KV-cache write of
 * `cache_write` in the same launch where it is not null. The handles are
 * the caller's (borrowed, as mlx_dualnorm_rope_inputs says); the
 * primitive's inputs take references of their own. */
int apply_fused_rope(mlx_vector_array* res, const mlx_dualnorm_rope_inputs* inputs,
                     const mlx_dualnorm_cache_write* cache_write, bool normalizes,
                     float rms_norm_epsilon, mlx_dualnorm_rope_parameters rope) {
  return launch_and_publish(res, kDualHeadNormRopeOperation, prepared_rope_kernel, [&] {
    std::optional<mlx_dualnorm_fused::CacheWrite> write;
    if (cache_write != nullptr) {
      write.emplace(mlx_dualnorm_fused::CacheWrite{
          borrowed_array(cache_write->values), borrowed_array(cache_write->key_cache),
          borrowed_array(cache_write->value_cache), cache_write->write_offset,
          cache_write->fetch});
    }
    return mlx_dualnorm_fused::fused_dual_head_norm_rope(
        borrowed_array(inputs->queries), borrowed_array(inputs->keys),
        borrowed_weight_or_null(inputs->query_scale_weight),
        borrowed_weight_or_null(inputs->key_scale_weight), borrowed_array(inputs->rope_offset),
        // Without norms the epsilon (NaN) is unread: 0 keeps equal nodes equal.
        normalizes ? rms_norm_epsilon : 0.0f, rope_constants(rope, normalizes),
        borrowed_weight_or_null(inputs->freqs),
        write ? &*write : nullptr);
  });
}

const mlx_dualnorm_fused_rope_backend fused_rope_backend = {
    {
        fused_backend_available,
        prepare_fused_rope_kernel,
        mlx_dualnorm_fused::kRopeInputRank, // the only rank the composite sends
        mlx_dualnorm_fused::kMaxRopeRowWidth,
    },
    apply_fused_rope,
    true, // the cache write in the norm + RoPE's launch
};

} // namespace

extern "C" const mlx_dualnorm_fused_backend* mlx_dualnorm_fused_backend_table(void) {
  return &fused_backend;
}

extern "C" const mlx_dualnorm_fused_rope_backend* mlx_dualnorm_fused_rope_backend_table(void) {
  return &fused_rope_backend;
}

extern "C" bool mlx_dualnorm_fused_outputs_in_device_pool(void) {
  return mlx_dualnorm_fused::outputs_use_stream_ordered_pool();
}
