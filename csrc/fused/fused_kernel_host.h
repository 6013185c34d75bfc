/* What the host side of both fused primitives shares (CUDA builds only:
 * it needs the headers of MLX's CUDA backend): their common base (GPU only,
 * the row variant chosen per launch), the kernels' row layout as MLX's
 * RMSNorm launches it, the loading of a cubin's kernels into MLX's CUDA
 * context, the optional weights among a node's inputs, the outputs' memory
 * and encoder registration, and the tangents of a jvp. Private to fused/. */
#ifndef MLX_DUALNORM_FUSED_KERNEL_HOST_H
#define MLX_DUALNORM_FUSED_KERNEL_HOST_H

#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda.h>

#include "mlx/array.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/device.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#include "fused/dual_head_norm_kernel.cuh"

namespace mlx_dualnorm_fused {

/* The kernels' argument layout (ContiguousRows, RowLayout,
 * DualHeadNormParams), from its one definition. */
MLX_DUALNORM_KERNEL_PARAMS

/* Whether both inputs are row-contiguous, so that a launch can take the
 * kernels' ContiguousRows variant (smaller arguments); otherwise RowLayout. */
bool rows_are_contiguous(const mlx::core::array& queries, const mlx::core::array& keys);

/* The rows of `input` (normalized along its last axis) as the kernel
 * variant `Rows` describes them, with MLX's block size for them; `weight`
 * may be null. ContiguousRows needs a row-contiguous input. */
template <typename Rows>
Rows rows_of(const mlx::core::array& input, const mlx::core::array* weight);

template <>
ContiguousRows rows_of<ContiguousRows>(const mlx::core::array& input,
                                       const mlx::core::array* weight);

template <>
RowLayout rows_of<RowLayout>(const mlx::core::array& input, const mlx::core::array* weight);

/* What both fused primitives are to MLX beside their kernel: a node that
 * runs on MLX's CUDA GPU only, over queries (input 0), keys (input 1), then
 * inputs of its own and the weights present, with the epsilon baked in.
 * eval_gpu launches the kernel variant the inputs allow: `Derived` defines
 * `template <typename Rows> void launch(inputs, outputs)` and befriends
 * this class, which calls it. */
template <typename Derived>
class RowKernelPrimitive : public mlx::core::Primitive {
 public:
  /* `operation` (static) names the errors, as "[operation] ...". */
  RowKernelPrimitive(const char* operation, mlx::core::Stream stream, float rms_norm_epsilon,
                     bool has_query_weight, bool has_key_weight)
      : mlx::core::Primitive(stream),
        operation_(operation),
        rms_norm_epsilon_(rms_norm_epsilon),
        has_query_weight_(has_query_weight),
        has_key_weight_(has_key_weight) {}

  void eval_cpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string("[") + operation_ + "] runs on MLX's CUDA GPU only");
  }

  void eval_gpu(const std::vector<mlx::core::array>& inputs,
                std::vector<mlx::core::array>& outputs) override {
    Derived& primitive = static_cast<Derived&>(*this);
    if (rows_are_contiguous(inputs[0], inputs[1])) {
      primitive.template launch<ContiguousRows>(inputs, outputs);
    } else {
      primitive.template launch<RowLayout>(inputs, outputs);
    }
  }

 protected:
  /* Whether `other` normalizes as this node does: is_equivalent's share. */
  bool normalizes_as(const RowKernelPrimitive& other) const {
    return rms_norm_epsilon_ == other.rms_norm_epsilon_ &&
           has_query_weight_ == other.has_query_weight_ &&
           has_key_weight_ == other.has_key_weight_;
  }

  const char* operation_;
  float rms_norm_epsilon_;
  bool has_query_weight_;
  bool has_key_weight_;
};

/* How both kernels launch: one block per row of either side (query rows
 * first), each block as wide as the wider side's MLX block size. A
 * RowLayout passes as its ContiguousRows fields. */
struct RowLaunch {
  dim3 grid;
  dim3 block;
};

RowLaunch row_launch(const ContiguousRows& queries, const ContiguousRows& keys);

/* Each kernel's index among a cubin's row variants: its entry points are
 * named PREFIX_contiguous_DTYPE and PREFIX_strided_DTYPE. */
template <typename Rows>
inline constexpr int kRowsVariantIndex = 1;

template <>
inline constexpr int kRowsVariantIndex<ContiguousRows> = 0;

/* The kernels of one cubin, for both row variants and float32, float16 and
 * bfloat16 (PREFIX_contiguous_float32 and so on), loaded once, at the first
 * evaluation, where MLX has the device context current. Driver entry
 * points come from the libcuda MLX loaded; the module is the process's
 * from then on. */
class KernelModule {
 public:
  /* `operation` prefixes every error, as "[operation] ..."; both strings
   * are static. */
  KernelModule(const char* operation, const char* kernel_prefix)
      : operation_(operation), kernel_prefix_(kernel_prefix) {}

  void set_cubin(std::string cubin) {
    cubin_ = std::move(cubin);
  }

  /* The kernel for `dtype` (float32, float16 or bfloat16) whose arguments
   * describe rows as `Rows` does. */
  template <typename Rows>
  CUfunction kernel_for(mlx::core::Dtype dtype, mlx::core::Device device) {
    return kernel_for(dtype, device, kRowsVariantIndex<Rows>);
  }

 private:
  static constexpr int kRowsVariants = 2;
  static constexpr int kKernelDtypes = 3;

  CUfunction kernel_for(mlx::core::Dtype dtype, mlx::core::Device device, int rows_variant);
  void load();

  const char* operation_;
  const char* kernel_prefix_;
  std::string cubin_;
  std::once_flag loaded_;
  std::string load_failure_;
  CUfunction kernels_[kRowsVariants][kKernelDtypes] = {};
};

/* A fused node's optional weights. Its inputs are its fixed ones, then
 * the query weight and the key weight, each where present; null where
 * absent. Borrowed from the inputs. */
struct WeightInputs {
  const mlx::core::array* query = nullptr;
  const mlx::core::array* key = nullptr;
};

WeightInputs weight_inputs(const std::vector<mlx::core::array>& inputs, size_t first_weight,
                           bool has_query_weight, bool has_key_weight);

/* `fixed`, followed by the weights that are not null: a node's inputs. */
std::vector<mlx::core::array> inputs_with_weights(std::vector<mlx::core::array> fixed,
                                                  const mlx::core::array* query_weight,
                                                  const mlx::core::array* key_weight);

/* Whether any of `inputs` is a tracer: an array of a computation MLX is
 * transforming (grad, vjp, jvp, vmap, compile). The fused builders then
 * return the composed calls' own graph instead of one node: a transform
 * sees mlx's nodes in the order the composed path makes them, so
 * gradients accumulate in the same order and have the same bits (one node
 * for both sides is visited with its queries and keys together, which
 * reorders the sums of cotangents an input shared by several of the
 * graph's nodes receives). */
bool any_tracer(const std::vector<mlx::core::array>& inputs);

/* The weight as fast::rms_norm takes it. */
std::optional<mlx::core::array> optional_weight(const mlx::core::array* weight);

/* Tells the encoder what the next kernel reads and writes (outputs that
 * already have their memory), which orders it after the nodes that produce
 * its inputs. */
void register_arrays(mlx::core::cu::CommandEncoder& encoder,
                     const std::vector<mlx::core::array>& inputs,
                     const std::vector<mlx::core::array>& outputs);

} // namespace mlx_dualnorm_fused

#endif
