/* One side of a q/k head normalization (an input and its optional scale
 * weight), read once per call (internal).
 *
 * rms_norm checks its arguments when a graph is traced, and a compiled
 * replay checks nothing (a shapeless one would read a weight whose length
 * is not the inputs' width out of bounds without a word). Each apply
 * checks, on every call and here only, the preconditions rms_norm checks at
 * trace time, and reports them as invalid arguments. The facts read here
 * also choose the call's route: nothing about an input is read twice.
 */
#ifndef MLX_DUALNORM_PRIVATE_HEAD_NORM_INPUT_H
#define MLX_DUALNORM_PRIVATE_HEAD_NORM_INPUT_H

#include <stdbool.h>
#include <stddef.h>

#include "mlx_dualnorm/dual_head_norm_common.h"

/* What one call knows about one side, read once by inspect_head_norm_input
 * and used by the checks and the route choice alike. */
typedef struct head_norm_input {
  mlx_array array;  /* borrowed */
  mlx_array weight; /* borrowed; ctx NULL for no weight */
  mlx_dtype dtype;
  mlx_dtype weight_dtype; /* the input's dtype when there is no weight */
  size_t rank;
  int width;
  size_t size;
  size_t rows; /* 0 for an empty input */
  /* The heads one normalization spans: 1 (a norm per head, over the last
   * axis), or the second-to-last axis's extent where the weight is as long
   * as the last two axes together (OLMo-2's q/k norms over each token's
   * whole projection); set by inspect_head_norm_input. */
  int norm_heads;
} head_norm_input;

/* One call's inputs, and the default device's type once it is needed. */
typedef struct dual_head_norm_call {
  head_norm_input queries;
  head_norm_input keys;
  bool default_device_known;
  bool default_device_is_gpu;
} dual_head_norm_call;

const char* dualnorm_dtype_name(mlx_dtype dtype);

bool dualnorm_is_real_floating(mlx_dtype dtype);

/* The dtypes the fused CUDA kernels take: float32, float16, bfloat16. */
bool dualnorm_is_fused_dtype(mlx_dtype dtype);

/* Checks an object's RMS epsilon as given, before rounding to float32:
 * finite, >= 0 and within float32's range (-1e-50 is negative though it
 * rounds to -0.0; 1e39 is out of range though finite as a double). */
int dualnorm_check_rms_norm_epsilon(double rms_norm_epsilon, const char* operation,
                                    mlx_dualnorm_error* error);

/* The stream one side's graph runs on: the default device's, except for
 * an empty input, which goes to the CPU: there is nothing to compute, and
 * MLX 0.32.4's CUDA kernels cannot launch on an empty grid (its RMSNorm
 * divides by the width: SIGFPE at width 0). Empty inputs never reach a
 * compiled trace (they take the plain builder), so this is decided per
 * call. */
int dualnorm_select_side_stream(mlx_stream* stream, const mlx_array input,
                                const mlx_device default_device);

/* Reads the facts of one side and checks rms_norm's preconditions: at least
 * one dimension; a weight, if any, one-dimensional and as long as the last
 * dimension; and a result dtype, MLX's promotion of the input and weight
 * dtypes, that is a real floating type. Where `heads_may_share_norm` (the
 * norm + RoPE), a weight as long as the last two dimensions together (more
 * than one head) is taken too: the side is then normalized over all heads
 * of each row at once (`norm_heads`). Failures are invalid arguments of
 * `operation`. */
int dualnorm_inspect_head_norm_input(head_norm_input* side, const char* operation,
                                     const char* input_name, const mlx_array input,
                                     const char* weight_name, const mlx_array weight,
                                     bool heads_may_share_norm, mlx_dualnorm_error* error);

/* Whether the default device is the GPU, asked of MLX at most once a call
 * and only by the checks that depend on it. */
int dualnorm_default_device_is_gpu(dual_head_norm_call* call, const char* operation,
                                   bool* is_gpu, mlx_dualnorm_error* error);

/* Refuses a float64 input or weight when the default device is the GPU, as
 * MLX does when it builds the op (see head_norm_input.c). */
int dualnorm_check_float64_placement(dual_head_norm_call* call, const char* operation,
                                     mlx_dualnorm_error* error);

#endif
