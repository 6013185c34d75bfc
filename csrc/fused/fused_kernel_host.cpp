/* What both fused primitives share on the host (see fused_kernel_host.h). */
#include "fused/fused_kernel_host.h"

#include <dlfcn.h>

#include <algorithm>
#include <stdexcept>

#include "mlx/backend/cuda/device.h"
#include "mlx/ops.h"

namespace mlx_dualnorm_fused {

namespace {

namespace mx = mlx::core;

/* MLX's block size for rows of `width` elements of `dtype` (its
 * RMSNorm::eval_gpu dispatch), where each thread reads 16 bytes per chunk
 * (the kernel's READS). */
int launch_block(int width, mx::Dtype dtype) {
  const int reads = 16 / static_cast<int>(dtype.size());
  const int vectors = (width + reads - 1) / reads;
  if (width > reads * 1024) {
    return 1024;
  } else if (width <= reads * 64) {
    return 64;
  } else if (vectors % 128 == 0 && vectors / 128 <= 8) {
    return 128;
  } else if (vectors % 64 == 0 && vectors / 64 <= 8) {
    return 64;
  }
  return 128;
}

const char* const kRowsVariantNames[] = {"contiguous", "strided"};
const char* const kDtypeNames[] = {"float32", "float16", "bfloat16"};

} // namespace

bool rows_are_contiguous(const mx::array& queries, const mx::array& keys) {
  return queries.flags().row_contiguous && keys.flags().row_contiguous;
}

template <>
ContiguousRows rows_of<ContiguousRows>(const mx::array& input, const mx::array* weight) {
  ContiguousRows rows{};
  rows.width = input.shape().back();
  rows.rows = static_cast<int>(input.size() / rows.width);
  rows.block = launch_block(rows.width, input.dtype());
  rows.has_weight = weight != nullptr ? 1 : 0;
  rows.weight_stride = weight != nullptr ? weight->strides()[0] : 0;
  return rows;
}

template <>
RowLayout rows_of<RowLayout>(const mx::array& input, const mx::array* weight) {
  RowLayout layout{};
  static_cast<ContiguousRows&>(layout) = rows_of<ContiguousRows>(input, weight);
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
  return layout;
}

RowLaunch row_launch(const ContiguousRows& queries, const ContiguousRows& keys) {
  return RowLaunch{dim3(static_cast<unsigned int>(queries.rows + keys.rows)),
                   dim3(static_cast<unsigned int>(std::max(queries.block, keys.block)))};
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
  CUmodule loaded = nullptr;
  // Owned by the process from here: kernels stay valid until exit.
  bool complete = load_data(&loaded, cubin_.data()) == CUDA_SUCCESS;
  for (int variant = 0; complete && variant < kRowsVariants; ++variant) {
    for (int dtype = 0; complete && dtype < kKernelDtypes; ++dtype) {
      const std::string name = std::string(kernel_prefix_) + "_" + kRowsVariantNames[variant] +
                               "_" + kDtypeNames[dtype];
      complete = get_function(&kernels_[variant][dtype], loaded, name.c_str()) == CUDA_SUCCESS;
    }
  }
  if (!complete) {
    throw std::runtime_error(prefix + "the CUDA driver could not load the kernel");
  }
}

CUfunction KernelModule::kernel_for(mx::Dtype dtype, mx::Device device, int rows_variant) {
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
      return kernels_[rows_variant][0];
    case mx::Dtype::Val::float16:
      return kernels_[rows_variant][1];
    case mx::Dtype::Val::bfloat16:
      return kernels_[rows_variant][2];
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
  // Room for both weights at once: the list holds only the fixed inputs.
  fixed.reserve(fixed.size() + (query_weight != nullptr) + (key_weight != nullptr));
  for (const mx::array* weight : {query_weight, key_weight}) {
    if (weight != nullptr) {
      fixed.push_back(*weight);
    }
  }
  return fixed;
}

bool any_tracer(const std::vector<mx::array>& inputs) {
  return std::any_of(inputs.begin(), inputs.end(),
                     [](const mx::array& input) { return input.is_tracer(); });
}

std::optional<mx::array> optional_weight(const mx::array* weight) {
  return weight != nullptr ? std::optional<mx::array>(*weight) : std::nullopt;
}

void register_arrays(mx::cu::CommandEncoder& encoder, const std::vector<mx::array>& inputs,
                     const std::vector<mx::array>& outputs) {
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  for (const auto& output : outputs) {
    encoder.set_output_array(output);
  }
}

} // namespace mlx_dualnorm_fused
