/* FusedDualRmsNormRope: an MLX primitive whose GPU evaluation is ONE kernel
 * launch that normalizes, rotates and transposes every row of queries and
 * keys (dual_head_norm_rope_kernel.cuh), added to MLX's command encoder like
 * FusedDualRmsNorm. It replaces six graph nodes per layer (two rms_norm,
 * two transposes, two rope) with one; with the KV-cache write, eight (and
 * the value transpose) with one: the rotated keys and the transposed values
 * go straight into the cache's buffers.
 *
 * Built only where MLX's CUDA backend headers are found (build_ffi.py
 * lists it in the CUDA build's sources), like
 * fused_dual_head_norm_primitive.cpp.
 */
#include "fused/fused_dual_head_norm_rope_primitive.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>

#include "mlx/backend/cuda/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cuda/utils.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

#include "fused/dual_head_norm_rope_kernel.cuh"
#include "fused/fused_kernel_host.h"
#include "fused/output_memory.h"

namespace mlx_dualnorm_fused {

namespace {

namespace mx = mlx::core;

/* RopeSide, DualHeadNormRopeParams, StridedRows and
 * DualHeadNormRopeCacheParams, from their one definition. */
MLX_DUALNORM_ROPE_KERNEL_PARAMS
MLX_DUALNORM_ROPE_CACHE_KERNEL_PARAMS

/* Inputs in this order; with the KV-cache write the values and both
 * buffers follow; then the weights where present, then the frequency table
 * where the RoPE takes one. */
enum { kQueriesInput = 0, kKeysInput = 1, kOffsetInput = 2 };
enum { kValuesInput = 3, kKeyCacheInput = 4, kValueCacheInput = 5 };
constexpr size_t kCacheInputs = 3;

/* The cache axis of (B, H, capacity, D) buffers, where rows are written. */
constexpr int kCacheRowAxis = 2;

/* What a node with the KV-cache write outputs beyond the rotated queries:
 * both buffers with rows [first_row, first_row + L) written, and with
 * `fetch` also their rows [0, first_row + L), views of the written
 * buffers (what KVCache.update_and_fetch returns for attention). */
struct CacheOutputs {
  int first_row;
  bool fetch;

  bool operator==(const CacheOutputs& other) const {
    return first_row == other.first_row && fetch == other.fetch;
  }
};

/* (B, L, H, D) -> (B, H, L, D), as mlx-lm's attention transposes. */
const std::vector<int> kHeadMajorAxes = {0, 2, 1, 3};

/* The heads one normalization spans, per side: 1 (a norm per head), or all
 * H where the side's weight has H * D elements (OLMo-2's q/k norms over
 * each token's whole projection). Such a side is a node input of shape
 * (B, L, 1, H * D): one kernel row, and one rms_norm row, per token. */
struct NormHeads {
  int queries = 1;
  int keys = 1;

  bool operator==(const NormHeads& other) const {
    return queries == other.queries && keys == other.keys;
  }
};

const char kOperation[] = "fused_dual_head_norm_rope";

/* The cubin's kernels: mlx_dualnorm_dual_head_norm_rope_contiguous_float32 and so
 * on. */
KernelModule& kernel_module() {
  static KernelModule module(kOperation, "mlx_dualnorm_dual_head_norm_rope");
  return module;
}

/* The same cubin's entry points with the KV-cache write:
 * mlx_dualnorm_dual_head_norm_rope_cache_contiguous_float32 and so on. */
KernelModule& cache_kernel_module() {
  static KernelModule module(kOperation, "mlx_dualnorm_dual_head_norm_rope_cache");
  return module;
}

} // namespace

void set_rope_kernel_cubin(std::string cubin) {
  cache_kernel_module().set_cubin(cubin);
  kernel_module().set_cubin(std::move(cubin));
}

namespace {

/* Where one side's rows go (each node input row holds `norm_heads` heads),
 * and which of MLX's RoPE kernels (hence which position conversion) its
 * shape gets: MLX takes its single-row kernel for a row-contiguous input
 * with B == 1 and L == 1. The transpose of a normalized (1, 1, H, D) is
 * row-contiguous (rms_norm's output is); without norms RoPE reads the
 * transpose of the input itself, row-contiguous exactly where the input is
 * (the axes swapped have one element), so a strided view (a head sliced
 * out of a fused projection) takes MLX's general kernel. */
RopeSide rope_side(const mx::array& input, int norm_heads, const mx::array& offset,
                   bool normalizes) {
  RopeSide side{};
  side.heads = input.shape(2) * norm_heads;
  side.row_heads = norm_heads;
  side.sequence = input.shape(1);
  side.offset_stride = offset.ndim() > 0 ? offset.strides()[0] : 0;
  const bool rope_input_row_contiguous = normalizes || input.flags().row_contiguous;
  side.signed_position =
      input.shape(0) == 1 && input.shape(1) == 1 && rope_input_row_contiguous ? 1 : 0;
  // A (B, H, L, D) output laid out token-major (token_major_strides); the
  // KV-cache write points the keys at their rows of the row-contiguous key
  // buffer instead.
  side.token_major = 1;
  side.output_sequence = side.sequence;
  side.output_first_row = 0;
  return side;
}

/* The rows of a rank-4 array over its first three axes, as the kernel
 * reads a source row by row. */
StridedRows strided_rows(const mx::array& input) {
  StridedRows rows{};
  for (int axis = 0; axis < 4; ++axis) {
    rows.strides[axis] = input.strides()[axis];
  }
  for (int axis = 0; axis < 3; ++axis) {
    rows.extents[axis] = input.shape(axis);
  }
  rows.width = input.shape(3);
  rows.rows = static_cast<int>(input.size() / std::max(input.shape(3), 1));
  return rows;
}

/* The offset's value where the host holds it without a copy: one element,
 * whose computation is complete (status available: a constant, such as the
 * scalar the bridge makes of an int, or a result already waited for), in
 * unified memory (CudaBuffer device -1, where MLX puts arrays made on the
 * host). Anything else is read by the kernel, in stream order: a scalar
 * computed earlier in the same evaluation is only `evaluated` here, its
 * kernel not yet run (is_available() would call such an array ready when
 * no event guards it, and its memory would be read too soon). */
std::optional<int32_t> host_readable_offset(const mx::array& offset) {
  if (offset.size() != 1 || offset.status() != mx::array::Status::available) {
    return std::nullopt;
  }
  const auto* buffer = static_cast<const mx::cu::CudaBuffer*>(offset.buffer().ptr());
  if (buffer == nullptr || buffer->device != -1) {
    return std::nullopt;
  }
  return *mx::gpu_ptr<int32_t>(offset);
}

/* The (B, H, L, D) output of a node input whose rows hold `norm_heads`
 * heads each. */
mx::Shape head_major_shape(const mx::array& input, int norm_heads) {
  return {input.shape(0), input.shape(2) * norm_heads, input.shape(1),
          input.shape(3) / norm_heads};
}

/* The shape of rows [0, end) of axis 2 of a (B, H, C, D) buffer. */
mx::Shape fetched_shape(const mx::array& buffer, int end) {
  mx::Shape shape = buffer.shape();
  shape[kCacheRowAxis] = end;
  return shape;
}

/* The composed KV-cache writes of mlx-lm's KVCache.update_and_fetch, the
 * transforms' share of the cache variant: rows [first_row, first_row + L)
 * of both buffers set, as `buffer[..., w:w+L, :] = update` does; with
 * `cache.fetch`, also rows [0, first_row + L) of both, as the class's
 * `buffer[..., :offset, :]` returns them. */
std::vector<mx::array> with_cache_writes(const mx::array& rotated_queries,
                                         const mx::array& rotated_keys, const mx::array& values,
                                         const mx::array& key_cache,
                                         const mx::array& value_cache,
                                         const CacheOutputs& cache, mx::Stream stream) {
  const int end = cache.first_row + rotated_keys.shape(kCacheRowAxis);
  auto write = [&](const mx::array& buffer, const mx::array& rows) {
    const mx::Shape& shape = buffer.shape();
    const mx::Shape start = {0, 0, cache.first_row, 0};
    const mx::Shape stop = {shape[0], shape[1], end, shape[3]};
    return mx::slice_update(buffer, rows, start, stop, stream);
  };
  std::vector<mx::array> outputs = {
      rotated_queries, write(key_cache, rotated_keys),
      write(value_cache, mx::transpose(values, kHeadMajorAxes, stream))};
  if (cache.fetch) {
    for (size_t buffer = 1; buffer < 3; ++buffer) {
      outputs.push_back(mx::slice(outputs[buffer], mx::Shape{0, 0, 0, 0},
                                  fetched_shape(outputs[buffer], end), stream));
    }
  }
  return outputs;
}

/* Makes `view` rows [0, end) of axis 2 of the row-contiguous buffer
 * output `buffer`, sharing its memory, with the strides, flags and data
 * size MLX's Slice gives the same view (backend/common/slicing.cpp): so
 * every later op reads it as it reads the class's `buffer[..., :end, :]`. */
void make_fetched_view(const mx::array& buffer, mx::array& view) {
  const mx::Strides& strides = buffer.strides();
  int64_t high_index = 0;
  for (size_t axis = 0; axis < strides.size(); ++axis) {
    high_index += strides[axis] * (view.shape(static_cast<int>(axis)) - 1);
  }
  const size_t data_size = view.size() == 0 ? 0 : static_cast<size_t>(high_index + 1);
  auto [unbroadcast_size, row_contiguous, col_contiguous] =
      mx::check_contiguity(view.shape(), strides);
  mx::array::Flags flags = buffer.flags();
  flags.row_contiguous = row_contiguous;
  flags.col_contiguous = col_contiguous;
  flags.contiguous = unbroadcast_size == data_size;
  view.copy_shared_buffer(buffer, strides, flags, data_size);
}

/* The output shapes of a node over `inputs` (in the node's order): rotated
 * queries and keys, or rotated queries, both buffers and (with
 * `cache->fetch`) their fetched rows. */
std::vector<mx::Shape> node_output_shapes(const std::vector<mx::array>& inputs,
                                          const NormHeads& norm_heads,
                                          const std::optional<CacheOutputs>& cache) {
  const mx::array& queries = inputs[kQueriesInput];
  const mx::array& keys = inputs[kKeysInput];
  if (!cache) {
    return {head_major_shape(queries, norm_heads.queries),
            head_major_shape(keys, norm_heads.keys)};
  }
  const mx::array& key_cache = inputs[kKeyCacheInput];
  const mx::array& value_cache = inputs[kValueCacheInput];
  std::vector<mx::Shape> shapes = {head_major_shape(queries, norm_heads.queries),
                                   key_cache.shape(), value_cache.shape()};
  if (cache->fetch) {
    const int end = cache->first_row + keys.shape(1);
    shapes.push_back(fetched_shape(key_cache, end));
    shapes.push_back(fetched_shape(value_cache, end));
  }
  return shapes;
}

/* The strides of a rotated (B, H, L, D) output in the memory order MLX's
 * RoPE leaves mlx-lm's transposed queries and keys in: that of the
 * (B, L, H, D) rows before the transpose (MLX's CUDA RoPE writes over its
 * input, or into memory laid out like it, keeping the input's strides;
 * only a partial rotation of an input it cannot write over is copied
 * head-major first, and there the layouts differ, never the values).
 * So the rows of a row-contiguous input lie exactly where the kernel
 * writes its output rows (`token_major`), and attention's output, which
 * follows the queries' layout, needs no copy to become (B, L, H * D). */
mx::Strides token_major_strides(const mx::array& output) {
  const int64_t heads = output.shape(1);
  const int64_t sequence = output.shape(2);
  const int64_t width = output.shape(3);
  return {sequence * heads * width, width, heads * width, 1};
}

/* Memory for the rotated rows of `input`, laid out token-major: the
 * input's own where the node may write over it (a projection nothing else
 * holds, as MLX's own RMS norm and RoPE write over theirs; a block writes
 * exactly the input row it read into shared memory before the barrier
 * that precedes its writes, and no other block reads it), else fresh. */
void rotated_output_memory(const mx::array& input, mx::array& output, size_t node_outputs,
                           mx::cu::CommandEncoder& encoder) {
  take_input_memory_or_allocate(input, output, token_major_strides(output), node_outputs,
                                encoder);
}

/* Outputs: rotated queries and rotated keys, (B, H, L, D) laid out
 * token-major (token_major_strides): each its input's memory where MLX
 * could donate it (rotated_output_memory), else fresh.
 * With the KV-cache write (`cache`): rotated queries as above, then the
 * key and value buffers, each its input's memory when MLX could donate it,
 * else a copy made in the same launch, then (with `cache->fetch`) the
 * views of their rows written so far, in the same order. */
class FusedDualRmsNormRope : public RowKernelPrimitive<FusedDualRmsNormRope> {
 public:
  FusedDualRmsNormRope(mx::Stream stream, float rms_norm_epsilon, const RopeConstants& rope,
                       bool has_query_weight, bool has_key_weight, NormHeads norm_heads,
                       std::optional<CacheOutputs> cache = std::nullopt)
      : RowKernelPrimitive(kOperation, stream, rms_norm_epsilon, has_query_weight,
                           has_key_weight),
        rope_(rope),
        norm_heads_(norm_heads),
        // As MLX's RoPE::eval_gpu: std::log2 of the float base, in float.
        log2_base_(std::log2(rope.base)),
        cache_(cache) {}

  /* No vjp, jvp or vmap: the builder never makes this node over a traced
   * input (any_tracer), so no transform reaches it; MLX's defaults refuse. */

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return node_output_shapes(inputs, norm_heads_, cache_);
  }

  /* The composed calls' outputs over a node's `inputs`, in the node's
   * output order: what the builder returns under a transform. */
  std::vector<mx::array> composed_outputs(const std::vector<mx::array>& inputs) {
    return composed_over(inputs)(without_offset(inputs));
  }

  /* The name MLX shows for the primitive in graphs and exports, kept as
   * released (what graph inspection matches): the one place the kernel's
   * older name, dual RMS norm, stays. */
  const char* name() const override {
    return "FusedDualRmsNormRope";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& fused = static_cast<const FusedDualRmsNormRope&>(other);
    return normalizes_as(fused) && rope_.normalizes == fused.rope_.normalizes &&
           rope_.dims == fused.rope_.dims &&
           rope_.traditional == fused.rope_.traditional && rope_.base == fused.rope_.base &&
           rope_.scale == fused.rope_.scale && rope_.with_freqs == fused.rope_.with_freqs &&
           rope_.has_input_scale == fused.rope_.has_input_scale &&
           (!rope_.has_input_scale || rope_.input_scale == fused.rope_.input_scale) &&
           norm_heads_ == fused.norm_heads_ && cache_ == fused.cache_;
  }

 private:
  friend class RowKernelPrimitive<FusedDualRmsNormRope>;

  /* Where the weights start among the inputs. */
  size_t first_weight_input() const {
    return 3 + (cache_ ? kCacheInputs : 0);
  }

  /* The node's outputs: rotated queries and keys, or the cache write's. */
  size_t output_count() const {
    return !cache_ ? 2 : cache_->fetch ? 5 : 3;
  }

  /* One launch of the kernel variant whose arguments describe rows as
   * `Rows` does. */
  template <typename Rows>
  void launch(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    if (cache_) {
      launch_with_cache<Rows>(inputs, outputs);
    } else {
      launch_rotation<Rows>(inputs, outputs);
    }
  }

  /* The norm + RoPE's kernel arguments for these inputs (either kernel). */
  template <typename Rows>
  DualHeadNormRopeParams<Rows> rotation_params(const std::vector<mx::array>& inputs,
                                              const WeightInputs& weights) const {
    const mx::array& queries = inputs[kQueriesInput];
    const mx::array& keys = inputs[kKeysInput];
    const mx::array& offset = inputs[kOffsetInput];
    DualHeadNormRopeParams<Rows> params{};
    params.queries = rows_of<Rows>(queries, weights.query);
    params.keys = rows_of<Rows>(keys, weights.key);
    params.query_rope = rope_side(queries, norm_heads_.queries, offset, rope_.normalizes);
    params.key_rope = rope_side(keys, norm_heads_.keys, offset, rope_.normalizes);
    params.eps = rms_norm_epsilon_;
    params.normalizes = rope_.normalizes ? 1 : 0;
    params.dims = rope_.dims;
    params.traditional = rope_.traditional ? 1 : 0;
    params.scale = rope_.scale;
    params.log2_base = log2_base_;
    if (rope_.with_freqs) {
      const mx::array& freqs = inputs.back();
      params.freqs = mx::gpu_ptr<float>(freqs);
      params.freq_stride = freqs.strides()[0];
    }
    if (rope_.has_input_scale) {
      params.has_input_scale = 1;
      params.input_scale = input_scale_in(queries.dtype(), rope_.input_scale);
    }
    if (std::optional<int32_t> constant_offset = host_readable_offset(offset)) {
      params.has_constant_offset = 1;
      params.constant_offset = *constant_offset;
    }
    return params;
  }

  /* Shared memory per block: the wider side's normalized row, rounded up
   * to 16 bytes. */
  static uint32_t row_bytes(const ContiguousRows& queries, const ContiguousRows& keys,
                            size_t itemsize) {
    const size_t widest = static_cast<size_t>(std::max(queries.width, keys.width));
    return static_cast<uint32_t>((widest * itemsize + 15) / 16 * 16);
  }

  template <typename Rows>
  void launch_rotation(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& encoder = mx::cu::get_command_encoder(stream());
    const mx::array& queries = inputs[kQueriesInput];
    CUfunction kernel = kernel_module().kernel_for<Rows>(queries.dtype(), stream().device);
    const WeightInputs weights =
        weight_inputs(inputs, first_weight_input(), has_query_weight_, has_key_weight_);
    DualHeadNormRopeParams<Rows> params = rotation_params<Rows>(inputs, weights);
    // Every output of this node holds its own copy of the node's inputs.
    rotated_output_memory(queries, outputs[0], outputs.size(), encoder);
    rotated_output_memory(inputs[kKeysInput], outputs[1], outputs.size(), encoder);
    register_arrays(encoder, inputs, outputs);
    void* query_data = mx::gpu_ptr<void>(queries);
    void* key_data = mx::gpu_ptr<void>(inputs[kKeysInput]);
    void* query_weight = weights.query ? mx::gpu_ptr<void>(*weights.query) : nullptr;
    void* key_weight = weights.key ? mx::gpu_ptr<void>(*weights.key) : nullptr;
    void* offsets = mx::gpu_ptr<void>(inputs[kOffsetInput]);
    void* rotated_queries = mx::gpu_ptr<void>(outputs[0]);
    void* rotated_keys = mx::gpu_ptr<void>(outputs[1]);
    void* arguments[] = {&query_data, &key_data,        &query_weight, &key_weight,
                         &offsets,    &rotated_queries, &rotated_keys, &params};
    const RowLaunch shape = row_launch(params.queries, params.keys);
    encoder.add_kernel_node_raw(kernel, shape.grid, shape.block, dim3(),
                                row_bytes(params.queries, params.keys, queries.itemsize()),
                                arguments);
  }

  /* The cache write's outputs given memory and registered with the
   * encoder: rotated queries (rotated_output_memory); each buffer its input's memory
   * (take_buffer_or_allocate) or fresh memory, whose other rows the launch
   * then copies (`params`' key_source / value_source); the fetched views
   * (outputs 3 and 4) sharing the buffers' memory once they have it. */
  template <typename Params>
  void prepare_cache_outputs(mx::cu::CommandEncoder& encoder,
                             const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs, Params& params) const {
    const mx::array& key_cache = inputs[kKeyCacheInput];
    const mx::array& value_cache = inputs[kValueCacheInput];
    // Every output of this node holds its own copy of the node's inputs.
    const size_t holders = outputs.size();
    rotated_output_memory(inputs[kQueriesInput], outputs[0], holders, encoder);
    if (!take_buffer_or_allocate(key_cache, outputs[1], holders, encoder)) {
      params.key_source = strided_rows(key_cache);
    }
    if (!take_buffer_or_allocate(value_cache, outputs[2], holders, encoder)) {
      params.value_source = strided_rows(value_cache);
    }
    if (cache_->fetch) {
      make_fetched_view(outputs[1], outputs[3]);
      make_fetched_view(outputs[2], outputs[4]);
    }
    for (const auto& input : inputs) {
      encoder.set_input_array(input);
    }
    for (size_t output = 0; output < 3; ++output) {
      encoder.set_output_array(outputs[output]);
    }
  }

  /* The launch with the KV-cache write: the keys rotated into their rows of
   * the key buffer, the values transposed into theirs, and each buffer
   * either the input's memory (written in place) or a fresh one the same
   * launch fills with the input's other rows. */
  template <typename Rows>
  void launch_with_cache(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& encoder = mx::cu::get_command_encoder(stream());
    const mx::array& queries = inputs[kQueriesInput];
    const mx::array& values = inputs[kValuesInput];
    const mx::array& key_cache = inputs[kKeyCacheInput];
    const mx::array& value_cache = inputs[kValueCacheInput];
    CUfunction kernel =
        cache_kernel_module().kernel_for<Rows>(queries.dtype(), stream().device);
    const WeightInputs weights =
        weight_inputs(inputs, first_weight_input(), has_query_weight_, has_key_weight_);
    DualHeadNormRopeCacheParams<Rows> params{};
    params.rope = rotation_params<Rows>(inputs, weights);
    params.rope.key_rope.token_major = 0;
    params.rope.key_rope.output_sequence = key_cache.shape(kCacheRowAxis);
    params.rope.key_rope.output_first_row = cache_->first_row;
    params.values = strided_rows(values);
    params.value_capacity = value_cache.shape(kCacheRowAxis);
    params.first_row = cache_->first_row;
    prepare_cache_outputs(encoder, inputs, outputs, params);
    void* query_data = mx::gpu_ptr<void>(queries);
    void* key_data = mx::gpu_ptr<void>(inputs[kKeysInput]);
    void* value_data = mx::gpu_ptr<void>(values);
    void* query_weight = weights.query ? mx::gpu_ptr<void>(*weights.query) : nullptr;
    void* key_weight = weights.key ? mx::gpu_ptr<void>(*weights.key) : nullptr;
    void* offsets = mx::gpu_ptr<void>(inputs[kOffsetInput]);
    void* key_source = mx::gpu_ptr<void>(key_cache);
    void* value_source = mx::gpu_ptr<void>(value_cache);
    void* rotated_queries = mx::gpu_ptr<void>(outputs[0]);
    void* written_keys = mx::gpu_ptr<void>(outputs[1]);
    void* written_values = mx::gpu_ptr<void>(outputs[2]);
    void* arguments[] = {&query_data,   &key_data,        &value_data,   &query_weight,
                         &key_weight,   &offsets,         &key_source,   &value_source,
                         &rotated_queries, &written_keys, &written_values, &params};
    const RowLaunch shape = row_launch(params.rope.queries, params.rope.keys);
    const long long blocks = static_cast<long long>(shape.grid.x) + params.values.rows +
                             params.key_source.rows + params.value_source.rows;
    if (blocks > std::numeric_limits<int>::max()) {
      throw std::invalid_argument(std::string("[") + kOperation +
                                  "] the cache buffers have too many rows for one launch");
    }
    encoder.add_kernel_node_raw(
        kernel, dim3(static_cast<unsigned int>(blocks)), shape.block, dim3(),
        row_bytes(params.rope.queries, params.rope.keys, queries.itemsize()), arguments);
  }

  /* Every input but the offset (the values and buffers of the KV-cache
   * write and the frequency table included). */
  std::vector<mx::array> without_offset(const std::vector<mx::array>& inputs) const {
    std::vector<mx::array> kept;
    for (size_t index = 0; index < inputs.size(); ++index) {
      if (index != kOffsetInput) {
        kept.push_back(inputs[index]);
      }
    }
    return kept;
  }

  /* The composed calls over without_offset(node_inputs): queries, keys,
   * (values, key and value buffers,) weights... (and the table last), the
   * offset fixed from `node_inputs`. The same ops as the C builder
   * (dual_head_norm_rope_graph.c). */
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> composed_over(
      const std::vector<mx::array>& node_inputs) {
    return [eps = rms_norm_epsilon_, rope = rope_, has_query_weight = has_query_weight_,
            has_key_weight = has_key_weight_, stream = stream(),
            offset = node_inputs[kOffsetInput], first_weight = first_weight_input(),
            norm_heads = norm_heads_, cache = cache_](const std::vector<mx::array>& inputs) {
      // The offset is not among these inputs: every later input comes one
      // earlier.
      const WeightInputs weights =
          weight_inputs(inputs, first_weight - 1, has_query_weight, has_key_weight);
      std::optional<mx::array> freqs;
      if (rope.with_freqs) {
        freqs = inputs.back();
      }
      std::optional<float> base;
      if (!rope.with_freqs) {
        base = rope.base;
      }
      auto side = [&](const mx::array& input, const mx::array* weight, int heads_per_row) {
        mx::array normalized =
            rope.normalizes ? mx::fast::rms_norm(input, optional_weight(weight), eps, stream)
                            : input;
        if (heads_per_row > 1) {  // (B, L, 1, H * D) normalized per token, then split
          normalized = mx::reshape(normalized,
                                   {input.shape(0), input.shape(1), heads_per_row,
                                    input.shape(3) / heads_per_row},
                                   stream);
        }
        mx::array head_major = mx::transpose(normalized, kHeadMajorAxes, stream);
        if (rope.has_input_scale) {
          const mx::Shape& shape = head_major.shape();
          head_major = mx::slice_update_prod(
              head_major, mx::astype(mx::array(rope.input_scale), head_major.dtype(), stream),
              {0, 0, 0, 0}, {shape[0], shape[1], shape[2], rope.dims}, {1, 1, 1, 1}, stream);
        }
        return mx::fast::rope(head_major, rope.dims, rope.traditional, base, rope.scale, offset,
                              freqs, stream);
      };
      mx::array rotated_queries = side(inputs[kQueriesInput], weights.query, norm_heads.queries);
      mx::array rotated_keys = side(inputs[kKeysInput], weights.key, norm_heads.keys);
      if (!cache) {
        return std::vector<mx::array>{rotated_queries, rotated_keys};
      }
      return with_cache_writes(rotated_queries, rotated_keys, inputs[kValuesInput - 1],
                               inputs[kKeyCacheInput - 1], inputs[kValueCacheInput - 1],
                               *cache, stream);
    };
  }

  /* The input scale as the kernel multiplies by it: rounded to the inputs'
   * dtype, as MLX makes a Python float into a scalar of that dtype. */
  static float input_scale_in(mx::Dtype dtype, float input_scale) {
    if (dtype == mx::bfloat16) {
      return static_cast<float>(static_cast<mx::bfloat16_t>(input_scale));
    }
    if (dtype == mx::float16) {
      return static_cast<float>(static_cast<mx::float16_t>(input_scale));
    }
    return input_scale;
  }

  RopeConstants rope_;
  NormHeads norm_heads_;
  float log2_base_;
  /* The KV-cache write's outputs; none for the norm + RoPE alone. */
  std::optional<CacheOutputs> cache_;
};

/* The heads one normalization of a (B, L, H, D) side spans: all H (> 1)
 * for a weight of H * D elements, else 1. */
int norm_heads_of(const mx::array& input, const mx::array* weight) {
  const int heads = input.shape(2);
  const bool spans = weight != nullptr && heads > 1 && input.shape(3) > 0 &&
                     weight->shape(0) == static_cast<int64_t>(heads) * input.shape(3);
  return spans ? heads : 1;
}

/* A side as the node takes it: as is, or, normalized over all its heads,
 * as (B, L, 1, H * D) (a view of a row-contiguous input, a copy of a
 * strided one, as MLX's reshape makes it). */
mx::array as_node_rows(const mx::array& input, int norm_heads, mx::Stream stream) {
  if (norm_heads == 1) {
    return input;
  }
  return mx::reshape(input, {input.shape(0), input.shape(1), 1, input.shape(2) * input.shape(3)},
                     stream);
}

/* The node's inputs before the weights: the offset as int32, as the
 * kernel reads it (MLX's RoPE converts offsets whose dtype is not 4 bytes
 * wide the same way), after `leading`. */
std::vector<mx::array> with_int32_offset(std::vector<mx::array> leading, const mx::array& offset,
                                         mx::Stream stream) {
  leading.insert(leading.begin() + kOffsetInput,
                 offset.itemsize() == 4 ? offset : mx::astype(offset, mx::int32, stream));
  return leading;
}

/* Appends the frequency table a RoPE with freqs needs, as float32 (what
 * MLX's RoPE reads after the same conversion); `operation` names the
 * error. */
void append_freqs(std::vector<mx::array>& inputs, const RopeConstants& rope,
                  const mx::array* freqs, const char* operation, mx::Stream stream) {
  if (!rope.with_freqs) {
    return;
  }
  if (freqs == nullptr) {
    throw std::invalid_argument(std::string("[") + operation +
                                "] a RoPE with freqs needs a table");
  }
  inputs.push_back(freqs->dtype() == mx::float32 ? *freqs
                                                 : mx::astype(*freqs, mx::float32, stream));
}

} // namespace

std::vector<mx::array> fused_dual_head_norm_rope(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array* query_weight,
    const mx::array* key_weight,
    const mx::array& offset,
    float rms_norm_epsilon,
    const RopeConstants& rope,
    const mx::array* freqs,
    const CacheWrite* cache) {
  const mx::Stream stream = mx::default_stream(mx::Device::gpu);
  const mx::Dtype dtype = queries.dtype();
  const NormHeads norm_heads{norm_heads_of(queries, query_weight), norm_heads_of(keys, key_weight)};
  std::vector<mx::array> leading = {as_node_rows(queries, norm_heads.queries, stream),
                                    as_node_rows(keys, norm_heads.keys, stream)};
  std::optional<CacheOutputs> outputs;
  if (cache != nullptr) {
    for (const mx::array* input : {&keys, &cache->values, &cache->key_cache, &cache->value_cache}) {
      if (input->dtype() != dtype) {
        throw std::invalid_argument(std::string("[") + kOperation +
                                    "] the KV-cache write needs one dtype for queries, keys, "
                                    "values and both buffers");
      }
    }
    leading.insert(leading.end(), {cache->values, cache->key_cache, cache->value_cache});
    outputs = CacheOutputs{cache->first_row, cache->fetch};
  }
  std::vector<mx::array> inputs = inputs_with_weights(
      with_int32_offset(std::move(leading), offset, stream), query_weight, key_weight);
  append_freqs(inputs, rope, freqs, kOperation, stream);
  auto primitive = std::make_shared<FusedDualRmsNormRope>(
      stream, rms_norm_epsilon, rope, query_weight != nullptr, key_weight != nullptr, norm_heads,
      outputs);
  if (any_tracer(inputs)) {  // under a transform: the composed graph (any_tracer says why)
    return primitive->composed_outputs(inputs);
  }
  std::vector<mx::Shape> shapes = node_output_shapes(inputs, norm_heads, outputs);
  const std::vector<mx::Dtype> dtypes(shapes.size(), dtype);
  return mx::array::make_arrays(std::move(shapes), dtypes, std::move(primitive),
                                std::move(inputs));
}

} // namespace mlx_dualnorm_fused
