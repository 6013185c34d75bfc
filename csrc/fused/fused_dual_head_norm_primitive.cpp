/* FusedDualRmsNorm: an MLX primitive whose GPU evaluation is ONE kernel
 * launch over the rows of queries and keys, added to MLX's own command
 * encoder like MLX's built-in RMSNorm (same graph-node cost, no source
 * string, no per-call code copy or hash: precompiled_cuda_kernel copies and
 * hashes the whole module on every call, which made a launch through it
 * slower than the composed kernels; docs/performance.md, "Fused
 * launches").
 *
 * Built only where MLX's CUDA backend headers, the CUDA toolkit headers and
 * fmt's headers (which MLX's headers include) are found: build_ffi.py
 * lists it in the CUDA build's sources.
 */
#include "fused/fused_dual_head_norm_primitive.h"

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

#include "fused/fused_kernel_host.h"
#include "fused/output_memory.h"

namespace mlx_dualnorm_fused {

namespace {

namespace mx = mlx::core;

/* Inputs in this order; the weights follow where present. */
enum { kQueriesInput = 0, kKeysInput = 1, kFirstWeightInput = 2 };

const char kOperation[] = "fused_dual_head_norm";

/* The cubin's kernels: mlx_dualnorm_dual_head_norm_contiguous_float32 and so on. */
KernelModule& kernel_module() {
  static KernelModule module(kOperation, "mlx_dualnorm_dual_head_norm");
  return module;
}

} // namespace

void set_kernel_cubin(std::string cubin) {
  kernel_module().set_cubin(std::move(cubin));
}

namespace {

/* Outputs: normalized queries, normalized keys, row-contiguous: each its
 * input's memory where MLX could donate it, as MLX's own RMS norm writes
 * over its input (normalize_row reads and writes only each thread's own
 * elements), else fresh. */
class FusedDualRmsNorm : public RowKernelPrimitive<FusedDualRmsNorm> {
 public:
  FusedDualRmsNorm(mx::Stream stream, float rms_norm_epsilon, bool has_query_weight,
                   bool has_key_weight)
      : RowKernelPrimitive(kOperation, stream, rms_norm_epsilon, has_query_weight,
                           has_key_weight) {}

  /* No vjp, jvp or vmap: the builder never makes this node over a traced
   * input (any_tracer), so no transform reaches it; MLX's defaults refuse. */

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape()};
  }

  /* The name MLX shows for the primitive in graphs and exports, kept as
   * released (what graph inspection matches): the one place the kernel's
   * older name, dual RMS norm, stays. */
  const char* name() const override {
    return "FusedDualRmsNorm";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return normalizes_as(static_cast<const FusedDualRmsNorm&>(other));
  }

  /* The composed computation over this primitive's inputs (also the
   * graph the builder returns under a transform). */
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> composed() {
    return [eps = rms_norm_epsilon_, has_query_weight = has_query_weight_,
            has_key_weight = has_key_weight_, stream = stream()](
               const std::vector<mx::array>& inputs) {
      const WeightInputs weights =
          weight_inputs(inputs, kFirstWeightInput, has_query_weight, has_key_weight);
      return std::vector<mx::array>{
          mx::fast::rms_norm(inputs[kQueriesInput], optional_weight(weights.query), eps, stream),
          mx::fast::rms_norm(inputs[kKeysInput], optional_weight(weights.key), eps, stream)};
    };
  }

 private:
  friend class RowKernelPrimitive<FusedDualRmsNorm>;

  /* One launch of the kernel variant whose arguments describe rows as
   * `Rows` does. */
  template <typename Rows>
  void launch(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& encoder = mx::cu::get_command_encoder(stream());
    CUfunction kernel =
        kernel_module().kernel_for<Rows>(inputs[kQueriesInput].dtype(), stream().device);
    const WeightInputs weights =
        weight_inputs(inputs, kFirstWeightInput, has_query_weight_, has_key_weight_);
    DualHeadNormParams<Rows> params{};
    params.queries = rows_of<Rows>(inputs[kQueriesInput], weights.query);
    params.keys = rows_of<Rows>(inputs[kKeysInput], weights.key);
    params.eps = rms_norm_epsilon_;
    // Every output of this node holds its own copy of the node's inputs.
    for (size_t side : {kQueriesInput, kKeysInput}) {
      take_input_memory_or_allocate(inputs[side], outputs[side],
                                    mx::make_contiguous_strides(outputs[side].shape()),
                                    outputs.size(), encoder);
    }
    register_arrays(encoder, inputs, outputs);
    void* queries = mx::gpu_ptr<void>(inputs[kQueriesInput]);
    void* keys = mx::gpu_ptr<void>(inputs[kKeysInput]);
    void* query_weight = weights.query ? mx::gpu_ptr<void>(*weights.query) : nullptr;
    void* key_weight = weights.key ? mx::gpu_ptr<void>(*weights.key) : nullptr;
    void* normalized_queries = mx::gpu_ptr<void>(outputs[0]);
    void* normalized_keys = mx::gpu_ptr<void>(outputs[1]);
    void* arguments[] = {&queries, &keys, &query_weight, &key_weight,
                         &normalized_queries, &normalized_keys, &params};
    const RowLaunch shape = row_launch(params.queries, params.keys);
    encoder.add_kernel_node_raw(kernel, shape.grid, shape.block, dim3(), 0, arguments);
  }
};

} // namespace

std::vector<mx::array> fused_dual_head_norm(const mx::array& queries, const mx::array& keys,
                                           const mx::array* query_weight,
                                           const mx::array* key_weight, float rms_norm_epsilon) {
  const mx::Dtype dtype = queries.dtype();
  auto primitive =
      std::make_shared<FusedDualRmsNorm>(mx::default_stream(mx::Device::gpu), rms_norm_epsilon,
                                         query_weight != nullptr, key_weight != nullptr);
  std::vector<mx::array> inputs = inputs_with_weights({queries, keys}, query_weight, key_weight);
  if (any_tracer(inputs)) {  // under a transform: the composed graph (any_tracer says why)
    return primitive->composed()(inputs);
  }
  return mx::array::make_arrays({queries.shape(), keys.shape()}, {dtype, dtype},
                                std::move(primitive), std::move(inputs));
}

} // namespace mlx_dualnorm_fused
