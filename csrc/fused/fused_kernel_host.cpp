/* What both fused primitives share on the host (see fused_kernel_host.h). */
#include "fused/fused_kernel_host.h"

#include <dlfcn.h>

#include <stdexcept>

#include "mlx/backend/cuda/device.h"
#include "mlx/ops.h"

#include "fused/output_memory.h"

namespace mlx_dualnorm_fused {

namespace {

namespace mx = mlx::core;

/* MLX's block size for rows of `width` elements of `dtype` (its
 * RMSNorm::eval_gpu dispatch), where each thread reads 16 bytes per chunk
 * (the kernel's READS). */
void set_launch_shape(RowLayout& layout, mx::Dtype dtype) {
  const int reads = 16 / static_cast<int>(dtype.size());
  const int width = layout.width;
  const int vectors = (width + reads - 1) / reads;
  if (width > reads * 1024) {
    layout.block = 1024;
  } else if (width <= reads * 64) {
    layout.block = 64;
  } else if (vectors % 128 == 0 && vectors / 128 <= 8) {
    layout.block = 128;
  } else if (vectors % 64 == 0 && vectors / 64 <= 8) {
    layout.block = 64;
  } else {
    layout.block = 128;
  }
}

} // namespace

RowLayout row_layout(const mx::array& input, const mx::array* weight) {
  RowLayout layout{};
  layout.width = input.shape().back();
  layout.rows = static_cast<int>(input.size() / layout.width);
  if (input.flags().row_contiguous) {
    // Rows back to back: one (rows, width) view spares the kernel the
    // per-axis index arithmetic.
    layout.rank = 2;
    layout.shape[0] = layout.rows;
    layout.shape[1] = layout.width;
    layout.strides[0] = layout.width;
    layout.strides[1] = 1;
  } else {
    layout.rank = static_cast<int>(input.ndim());
    for (int axis = 0; axis < layout.rank; ++axis) {
      layout.shape[axis] = input.shape(axis);
      layout.strides[axis] = input.strides()[axis];
    }
  }
  layout.has_weight = weight != nullptr ? 1 : 0;
  layout.weight_stride = weight != nullptr ? weight->strides()[0] : 0;
  set_launch_shape(layout, input.dtype());
  return layout;
}

void KernelModule::load() {
  const std::string prefix = std::string("[") + operation_ + "] ";
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (driver == nullptr) {
    throw std::runtime_error(prefix + "libcuda.so.1 is not loaded");
  }
  auto load_data = reinterpret_cast<CUresult (*)(CUmodule*, const void*)>(
      dlsym(driver, "cuModuleLoadData"));
  auto get_function = reinterpret_cast<CUresult (*)(CUfunction*, CUmodule, const char*)>(
      dlsym(driver, "cuModuleGetFunction"));
  if (load_data == nullptr || get_function == nullptr) {
    throw std::runtime_error(prefix + "the CUDA driver lacks module loading");
  }
  const std::string name = kernel_prefix_;
  CUmodule loaded = nullptr;
  // Owned by the process from here: kernels stay valid until exit.
  if (load_data(&loaded, cubin_.data()) != CUDA_SUCCESS ||
      get_function(&float32_kernel_, loaded, (name + "_float32").c_str()) != CUDA_SUCCESS ||
      get_function(&float16_kernel_, loaded, (name + "_float16").c_str()) != CUDA_SUCCESS ||
      get_function(&bfloat16_kernel_, loaded, (name + "_bfloat16").c_str()) != CUDA_SUCCESS) {
    throw std::runtime_error(prefix + "the CUDA driver could not load the kernel");
  }
}

CUfunction KernelModule::kernel_for(mx::Dtype dtype, mx::Device device) {
  std::call_once(loaded_, [this, device] {
    try {
      mx::cu::device(device).make_current();
      load();
    } catch (const std::exception& e) {
      load_failure_ = e.what();
    }
  });
  if (!load_failure_.empty()) {
    throw std::runtime_error(load_failure_);
  }
  switch (dtype.val()) {
    case mx::Dtype::Val::float32:
      return float32_kernel_;
    case mx::Dtype::Val::float16:
      return float16_kernel_;
    case mx::Dtype::Val::bfloat16:
      return bfloat16_kernel_;
    default:
      throw std::invalid_argument(std::string("[") + operation_ + "] unsupported dtype");
  }
}

WeightInputs weight_inputs(const std::vector<mx::array>& inputs, size_t first_weight,
                           bool has_query_weight, bool has_key_weight) {
  WeightInputs weights;
  if (has_query_weight) {
    weights.query = &inputs[first_weight];
  }
  if (has_key_weight) {
    weights.key = &inputs[first_weight + (has_query_weight ? 1 : 0)];
  }
  return weights;
}

std::vector<mx::array> inputs_with_weights(std::vector<mx::array> fixed,
                                           const mx::array* query_weight,
                                           const mx::array* key_weight) {
  for (const mx::array* weight : {query_weight, key_weight}) {
    if (weight != nullptr) {
      fixed.push_back(*weight);
    }
  }
  return fixed;
}

std::optional<mx::array> optional_weight(const mx::array* weight) {
  return weight != nullptr ? std::optional<mx::array>(*weight) : std::nullopt;
}

void prepare_outputs(mx::cu::CommandEncoder& encoder, const std::vector<mx::array>& inputs,
                     std::vector<mx::array>& outputs) {
  for (auto& output : outputs) {
    output.set_data(output_memory(output.nbytes(), encoder));
  }
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  for (const auto& output : outputs) {
    encoder.set_output_array(output);
  }
}

std::vector<mx::array> tangents_for_every_primal(const std::vector<mx::array>& primals,
                                                 const std::vector<mx::array>& tangents,
                                                 const std::vector<int>& argnums,
                                                 mx::Stream stream) {
  std::vector<mx::array> every;
  for (const auto& primal : primals) {
    every.push_back(mx::zeros_like(primal, stream));
  }
  for (size_t i = 0; i < argnums.size(); ++i) {
    every[argnums[i]] = tangents[i];
  }
  return every;
}

} // namespace mlx_dualnorm_fused
