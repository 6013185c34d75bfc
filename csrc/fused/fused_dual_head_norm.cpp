/* The fused dual head norm's C API: availability, one-time kernel
 * compilation with NVRTC, and the launch through the FusedDualRmsNorm
 * primitive (fused_dual_rms_norm_primitive.cpp, CUDA builds only).
 *
 * NVRTC is found in the process (MLX's CUDA backend links it) and compiles
 * the kernel once, for the GPU's own architecture, at the first
 * preparation; a build without MLX's CUDA headers reports the fused mode
 * unavailable and never compiles anything.
 */
#include "fused/fused_dual_head_norm.h"

#include <dlfcn.h>

#include <limits>
#include <mutex>
#include <string>
#include <variant>

#include "mlx/device.h"

#include "fused/dual_rms_norm_kernel.cuh"
#include "fused/fused_dual_rms_norm_primitive.h"
#include "mlx/c/private/mlx.h"

namespace {

using namespace mlx_c_private;

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
void resolve(void* library, const char* symbol, Function& function) {
  function = reinterpret_cast<Function>(dlsym(library, symbol));
  if (function == nullptr) {
    throw std::runtime_error(std::string("[fused dual head norm] NVRTC lacks ") + symbol);
  }
}

/* The handle stays open for the process: MLX's CUDA backend holds the same
 * library, and the compiled cubin outlives the compiler anyway. */
NvrtcLibrary open_nvrtc() {
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
        "[fused dual head norm] NVRTC (libnvrtc.so) was not found; MLX's CUDA "
        "backend ships it as a dependency");
  }
  NvrtcLibrary nvrtc;
  resolve(library, "nvrtcCreateProgram", nvrtc.create_program);
  resolve(library, "nvrtcCompileProgram", nvrtc.compile_program);
  resolve(library, "nvrtcGetCUBINSize", nvrtc.get_cubin_size);
  resolve(library, "nvrtcGetCUBIN", nvrtc.get_cubin);
  resolve(library, "nvrtcGetProgramLogSize", nvrtc.get_program_log_size);
  resolve(library, "nvrtcGetProgramLog", nvrtc.get_program_log);
  resolve(library, "nvrtcDestroyProgram", nvrtc.destroy_program);
  return nvrtc;
}

size_t device_info_number(const char* key) {
  const auto& info = mx::device_info(mx::Device::gpu);
  auto entry = info.find(key);
  if (entry == info.end() || !std::holds_alternative<size_t>(entry->second)) {
    throw std::runtime_error(
        std::string("[fused dual head norm] MLX reports no GPU ") + key +
        "; the fused kernel needs the CUDA backend");
  }
  return std::get<size_t>(entry->second);
}

/* The cubin of the kernel for this GPU's architecture. The program is
 * destroyed on every path. */
std::string compile_kernel_cubin() {
  NvrtcLibrary nvrtc = open_nvrtc();
  std::string architecture = "--gpu-architecture=sm_" +
                             std::to_string(device_info_number("compute_capability_major")) +
                             std::to_string(device_info_number("compute_capability_minor"));
  NvrtcLibrary::Program program = nullptr;
  if (nvrtc.create_program(&program, mlx_dualnorm_fused::kDualRmsNormKernelSource,
                           "mlx_dualnorm_dual_rms_norm.cu", 0, nullptr, nullptr) != 0) {
    throw std::runtime_error("[fused dual head norm] nvrtcCreateProgram failed");
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
    failure = "[fused dual head norm] NVRTC could not compile the kernel (" +
              architecture + "): " + log;
  } else {
    size_t cubin_size = 0;
    if (nvrtc.get_cubin_size(program, &cubin_size) != 0 || cubin_size == 0) {
      failure = "[fused dual head norm] NVRTC produced no cubin for " + architecture;
    } else {
      cubin.resize(cubin_size);
      if (nvrtc.get_cubin(program, cubin.data()) != 0) {
        failure = "[fused dual head norm] nvrtcGetCUBIN failed";
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
};

/* Compiles the kernel and hands it to the primitive, once; `failure` says
 * why not. */
PreparedKernel& prepared_kernel() {
  static PreparedKernel kernel;
  std::call_once(kernel.once, [] {
#ifdef MLX_DUALNORM_WITH_CUDA
    try {
      mlx_dualnorm_fused::set_kernel_cubin(compile_kernel_cubin());
    } catch (const std::exception& e) {
      kernel.failure = e.what();
    }
#else
    kernel.failure =
        "[fused dual head norm] mlx_dualnorm was built without MLX's CUDA headers";
#endif
  });
  return kernel;
}

bool is_fused_dtype(mx::Dtype dtype) {
  return dtype == mx::float32 || dtype == mx::float16 || dtype == mx::bfloat16;
}

const mx::array* weight_or_null(const mlx_array weight) {
  return static_cast<const mx::array*>(weight.ctx);
}

} // namespace

extern "C" bool mlx_dualnorm_fused_backend_available(void) {
#ifdef MLX_DUALNORM_WITH_CUDA
  try {
    return mx::is_available(mx::Device::gpu) &&
           mx::device_info(mx::Device::gpu).count("compute_capability_major") > 0;
  } catch (const std::exception&) {
    return false;
  }
#else
  return false; // built without MLX's CUDA headers: no primitive to launch
#endif
}

extern "C" int mlx_dualnorm_fused_prepare(void) {
  return guarded([] {
    PreparedKernel& kernel = prepared_kernel();
    if (!kernel.failure.empty()) {
      throw std::runtime_error(kernel.failure);
    }
  });
}

extern "C" bool mlx_dualnorm_fused_supports(
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array query_scale_weight,
    const mlx_array key_scale_weight) {
  try {
    const char* c_function = "mlx_dualnorm_fused_supports";
    const mx::array& query_array = held<mx::array>(queries, c_function);
    const mx::array& key_array = held<mx::array>(keys, c_function);
    const mx::Dtype dtype = query_array.dtype();
    if (!is_fused_dtype(dtype) || key_array.dtype() != dtype || query_array.size() == 0 ||
        key_array.size() == 0 || query_array.ndim() > mlx_dualnorm_fused::kMaxRank ||
        key_array.ndim() > mlx_dualnorm_fused::kMaxRank ||
        mx::default_device() != mx::Device::gpu) {
      return false;
    }
    // One block per row, rows counted in int (the kernel's 32-bit row
    // index, CUDA's grid limit): larger calls take the compiled graph.
    const size_t rows = query_array.size() / static_cast<size_t>(query_array.shape().back()) +
                        key_array.size() / static_cast<size_t>(key_array.shape().back());
    if (rows > static_cast<size_t>(std::numeric_limits<int>::max())) {
      return false;
    }
    for (const mx::array* weight : {weight_or_null(query_scale_weight),
                                    weight_or_null(key_scale_weight)}) {
      if (weight != nullptr && weight->dtype() != dtype) {
        return false;
      }
    }
    return true;
  } catch (const std::exception& e) {
    report_exception(e);
  }
  return false;
}

extern "C" int mlx_dualnorm_fused_apply(
    mlx_vector_array* res,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array query_scale_weight,
    const mlx_array key_scale_weight,
    float rms_norm_epsilon) {
  return guarded([&] {
    const char* c_function = "mlx_dualnorm_fused_apply";
    PreparedKernel& kernel = prepared_kernel();
    if (!kernel.failure.empty()) {
      throw std::runtime_error(kernel.failure);
    }
#ifdef MLX_DUALNORM_WITH_CUDA
    assign(res,
        mlx_dualnorm_fused::fused_dual_rms_norm(
            held<mx::array>(queries, c_function), held<mx::array>(keys, c_function),
            weight_or_null(query_scale_weight), weight_or_null(key_scale_weight),
            rms_norm_epsilon),
        c_function);
#else
    (void)res, (void)queries, (void)keys, (void)query_scale_weight, (void)key_scale_weight;
    (void)rms_norm_epsilon, (void)c_function;
#endif
  });
}
