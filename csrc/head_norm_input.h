/* One side of a q/k head normalization (an input and its optional scale
 * weight), read once per call (internal).
 *
 * A shapeless compiled replay skips rms_norm's argument checks (it only
 * recomputes output shapes), so a weight whose length is not the inputs'
 * width would be read out of bounds without a word. Each apply therefore
 * checks, on every call and here only, the preconditions rms_norm checks at
 * trace time, and reports them as invalid arguments. The facts read here
 * also choose the call's route: nothing about an input is read twice.
 */
#ifndef MLX_DUALNORM_HEAD_NORM_INPUT_H
#define MLX_DUALNORM_HEAD_NORM_INPUT_H

#include <stdbool.h>
#include <stddef.h>

#include "dual_head_norm.h"

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

/* Reads the facts of one side and checks rms_norm's preconditions: at least
 * one dimension; a weight, if any, one-dimensional and as long as the last
 * dimension; and a result dtype, MLX's promotion of the input and weight
 * dtypes, that is a real floating type. Failures are invalid arguments of
 * `operation`. */
int dualnorm_inspect_head_norm_input(head_norm_input* side, const char* operation,
                                     const char* input_name, const mlx_array input,
                                     const char* weight_name, const mlx_array weight,
                                     mlx_dualnorm_error* error);

/* Whether the default device is the GPU, asked of MLX at most once a call
 * and only by the checks that depend on it. */
int dualnorm_default_device_is_gpu(dual_head_norm_call* call, const char* operation,
                                   bool* is_gpu, mlx_dualnorm_error* error);

/* Refuses a float64 input or weight when the default device is the GPU, as
 * MLX does when it builds the op (see head_norm_input.c). */
int dualnorm_check_float64_placement(dual_head_norm_call* call, const char* operation,
                                     mlx_dualnorm_error* error);

#endif
