/* One call's inputs, read and checked once (see head_norm_input.h). */
#include "private/head_norm_input.h"

#include "private/call_errors.h"

#include <float.h>
#include <math.h>

const char* dualnorm_dtype_name(mlx_dtype dtype) {
  static const char* const names[] = {
      [MLX_BOOL] = "bool",         [MLX_UINT8] = "uint8",     [MLX_UINT16] = "uint16",
      [MLX_UINT32] = "uint32",     [MLX_UINT64] = "uint64",   [MLX_INT8] = "int8",
      [MLX_INT16] = "int16",       [MLX_INT32] = "int32",     [MLX_INT64] = "int64",
      [MLX_FLOAT16] = "float16",   [MLX_FLOAT32] = "float32", [MLX_FLOAT64] = "float64",
      [MLX_BFLOAT16] = "bfloat16", [MLX_COMPLEX64] = "complex64",
  };
  return (unsigned)dtype <= MLX_COMPLEX64 ? names[dtype] : "unknown";
}

bool dualnorm_is_real_floating(mlx_dtype dtype) {
  return dtype == MLX_FLOAT16 || dtype == MLX_FLOAT32 || dtype == MLX_FLOAT64 ||
         dtype == MLX_BFLOAT16;
}

bool dualnorm_is_fused_dtype(mlx_dtype dtype) {
  return dtype == MLX_FLOAT32 || dtype == MLX_FLOAT16 || dtype == MLX_BFLOAT16;
}

int dualnorm_check_rms_norm_epsilon(double rms_norm_epsilon, const char* operation,
                                    mlx_dualnorm_error* error) {
  if (!isfinite(rms_norm_epsilon) || rms_norm_epsilon < 0.0 || rms_norm_epsilon > FLT_MAX) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "eps must be finite, >= 0 and within float32's range, got %g",
                              rms_norm_epsilon);
  }
  return MLX_DUALNORM_OK;
}

int dualnorm_select_side_stream(mlx_stream* stream, const mlx_array input,
                                const mlx_device default_device) {
  if (mlx_array_size(input) > 0) {
    return mlx_get_default_stream(stream, default_device);
  }
  mlx_device cpu_device = mlx_device_new_type(MLX_CPU, 0);
  int status = cpu_device.ctx == NULL || mlx_get_default_stream(stream, cpu_device) != 0;
  status |= mlx_device_free(cpu_device);
  return status;
}

/* Reads the facts of one side and checks rms_norm's preconditions: at least
 * one dimension; a weight, if any, one-dimensional and as long as the last
 * dimension (or, where `heads_may_share_norm`, as the last two: see the
 * header); and a result dtype, MLX's promotion of the input and weight
 * dtypes, that is a real floating type (promotion yields one exactly when
 * neither is complex and at least one is real floating). */
int dualnorm_inspect_head_norm_input(head_norm_input* side, const char* operation,
                                     const char* input_name, const mlx_array input,
                                     const char* weight_name, const mlx_array weight,
                                     bool heads_may_share_norm, mlx_dualnorm_error* error) {
  if (input.ctx == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s is an empty array handle", input_name);
  }
  side->array = input;
  side->weight = weight;
  side->rank = mlx_array_ndim(input);
  if (side->rank == 0) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s must have at least 1 dimension but have 0", input_name);
  }
  side->width = mlx_array_shape(input)[side->rank - 1];
  side->size = mlx_array_size(input);
  side->rows = side->width > 0 ? side->size / (size_t)side->width : 0;
  side->dtype = mlx_array_dtype(input);
  side->weight_dtype = side->dtype;
  side->norm_heads = 1;
  if (weight.ctx != NULL) {
    size_t weight_rank = mlx_array_ndim(weight);
    if (weight_rank != 1) {
      return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                       "%s must have 1 dimension but has %zu", weight_name, weight_rank);
    }
    int weight_length = mlx_array_shape(weight)[0];
    /* A weight as long as the last two dimensions together, where the
     * caller allows it: each norm spans all heads of its (b, l) row. */
    int all_heads = side->rank >= 2 ? mlx_array_shape(input)[side->rank - 2] : 1;
    long long all_heads_width = (long long)all_heads * side->width;  /* no int overflow */
    if (heads_may_share_norm && all_heads > 1 && side->width > 0 &&
        weight_length == all_heads_width) {
      side->norm_heads = all_heads;
    } else if (weight_length != side->width) {
      if (heads_may_share_norm && side->rank >= 2) {
        return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                         "%s has %d elements but the last dimension of %s is %d (or %lld "
                         "for a norm over all %d heads)", weight_name, weight_length,
                         input_name, side->width, all_heads_width, all_heads);
      }
      return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                       "%s has %d elements but the last dimension of %s is %d",
                       weight_name, weight_length, input_name, side->width);
    }
    side->weight_dtype = mlx_array_dtype(weight);
  }
  bool any_complex = side->dtype == MLX_COMPLEX64 || side->weight_dtype == MLX_COMPLEX64;
  if (any_complex || !(dualnorm_is_real_floating(side->dtype) || dualnorm_is_real_floating(side->weight_dtype))) {
    if (weight.ctx == NULL) {
      return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                       "%s have unsupported dtype %s; expected a floating dtype",
                       input_name, dualnorm_dtype_name(side->dtype));
    }
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s of dtype %s with a %s of dtype %s do not normalize to a "
                     "floating dtype",
                     input_name, dualnorm_dtype_name(side->dtype), weight_name,
                     dualnorm_dtype_name(side->weight_dtype));
  }
  return MLX_DUALNORM_OK;
}

/* Whether the default device is the GPU, asked of MLX at most once a call
 * and only by the checks that depend on it. */
int dualnorm_default_device_is_gpu(dual_head_norm_call* call, const char* operation,
                                   bool* is_gpu, mlx_dualnorm_error* error) {
  if (!call->default_device_known) {
    mlx_device default_device = mlx_device_new();
    mlx_device_type device_type = MLX_CPU;
    int status = mlx_get_default_device(&default_device) != 0 ||
                 mlx_device_get_type(&device_type, default_device) != 0;
    status |= mlx_device_free(default_device);
    if (status != 0) {
      return dualnorm_fail_in_mlx(error, operation);
    }
    call->default_device_known = true;
    call->default_device_is_gpu = device_type == MLX_GPU;
  }
  *is_gpu = call->default_device_is_gpu;
  return MLX_DUALNORM_OK;
}

/* MLX has no float64 on the GPU: its array constructor refuses any GPU op
 * with a float64 input or output (invalid_argument, a ValueError in Python),
 * so rms_norm on a GPU default device rejects a float64 input or weight
 * before anything runs, even an empty input. This apply rejects it the same
 * way; otherwise the failure would surface later as an MLX error, or not at
 * all for an empty input (which runs on the CPU stream, see dualnorm_select_side_stream). */
int dualnorm_check_float64_placement(dual_head_norm_call* call, const char* operation,
                                     mlx_dualnorm_error* error) {
  const head_norm_input* sides[2] = {&call->queries, &call->keys};
  static const char* const input_names[2] = {"queries", "keys"};
  static const char* const weight_names[2] = {"query_weight", "key_weight"};
  for (int index = 0; index < 2; ++index) {
    bool input_is_float64 = sides[index]->dtype == MLX_FLOAT64;
    if (!input_is_float64 && sides[index]->weight_dtype != MLX_FLOAT64) {
      continue;
    }
    bool is_gpu = false;
    int status = dualnorm_default_device_is_gpu(call, operation, &is_gpu, error);
    if (status != MLX_DUALNORM_OK || !is_gpu) {
      return status;
    }
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s %s dtype float64, which MLX does not support on the GPU "
                     "(the default device)",
                     input_is_float64 ? input_names[index] : weight_names[index],
                     input_is_float64 ? "have" : "has");
  }
  return MLX_DUALNORM_OK;
}
