/* C-level test of the compiled dual head norm, built by
 * scripts/run_sanitizers.sh with AddressSanitizer (LeakSanitizer included)
 * and UndefinedBehaviorSanitizer, or run under valgrind.
 *
 * Drives the C API the way a C caller would, with no Python in the
 * process: every output is compared bit for bit (memcmp) with two direct
 * mlx_fast_rms_norm calls, every handle is freed, and the failure paths
 * (invalid arguments, closed objects, MLX errors) are walked so the
 * sanitizers see their cleanup too. Covers:
 *   - objects with different epsilons, interleaved, every weight set,
 *     compiled and composed modes;
 *   - retraces (rank and dtype changes) after another object wrote the slot;
 *   - the uncompiled paths: widths 0 and 1, many rows;
 *   - invalid arguments, use after close, double close, NULLs, each
 *     reported in the caller's mlx_dualnorm_error (status, operation,
 *     description); a NULL record accepted;
 *   - raw mlx-c failures: return codes and messages, caught by a handler
 *     of the test's own, with no process exit;
 *   - threads calling shared objects while others build and free objects;
 *   - the norm + RoPE's versioned call struct: apply_call with and without
 *     a cache write (fetching or not) bit for bit the older entries'
 *     outputs, a struct_size below the first version's refused;
 *   - an object without norms: mlx-c's own transpose and rope, bit for bit;
 *     a weight refused.
 * Links only the composite and an mlx-c (libmlxc): the fused mode is a
 * plug-in this test does not register.
 * Prints one line per failed check and a summary; exits 1 on any failure.
 */
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dual_head_norm.h"
#include "dual_head_norm_rope.h"
#include "dual_head_norm_rope_cache.h"

static int failures = 0;
static int checks = 0;
static pthread_mutex_t report_lock = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(condition, ...)                                 \
  do {                                                        \
    pthread_mutex_lock(&report_lock);                         \
    ++checks;                                                 \
    if (!(condition)) {                                       \
      ++failures;                                             \
      fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__);  \
      fprintf(stderr, __VA_ARGS__);                           \
      fprintf(stderr, " [%s]\n", #condition);                 \
    }                                                         \
    pthread_mutex_unlock(&report_lock);                       \
  } while (0)

static const float EPSILONS[] = {1e-2f, 1e-4f, 1e-6f};

/* The operations the composite names in its error records. */
static const char COMPILE_OPERATION[] = "dual_head_norm";
static const char APPLY_OPERATION[] = "dual_head_norm";
static const char CLOSE_OPERATION[] = "dual_head_norm_close";
enum { EPSILON_COUNT = 3 };

/* ---- arrays ------------------------------------------------------------ */

/* Deterministic small values (|x| ~ 1e-3, so eps dominates), float32. */
static mlx_array small_float32(const int* shape, int rank, uint32_t seed) {
  size_t count = 1;
  for (int axis = 0; axis < rank; ++axis) {
    count *= (size_t)shape[axis];
  }
  float* values = malloc((count ? count : 1) * sizeof *values);
  uint32_t state = seed * 2654435761u + 1;
  for (size_t index = 0; index < count; ++index) {
    state = state * 1664525u + 1013904223u;
    values[index] = ((float)(state >> 8) / 16777216.0f - 0.5f) * 2e-3f;
  }
  mlx_array array = mlx_array_new_data(values, shape, rank, MLX_FLOAT32);
  free(values);
  return array;
}

/* The same values as float64 (a dtype change for the compile cache). */
static mlx_array small_float64(const int* shape, int rank, uint32_t seed) {
  mlx_array single = small_float32(shape, rank, seed);
  size_t count = mlx_array_size(single);
  mlx_array_eval(single);
  const float* source = mlx_array_data_float32(single);
  double* values = malloc((count ? count : 1) * sizeof *values);
  for (size_t index = 0; index < count; ++index) {
    values[index] = source[index];
  }
  mlx_array array = mlx_array_new_data(values, shape, rank, MLX_FLOAT64);
  free(values);
  mlx_array_free(single);
  return array;
}

static mlx_array weight_float32(int width, float scale) {
  float* values = malloc((width ? width : 1) * sizeof *values);
  for (int index = 0; index < width; ++index) {
    values[index] = scale * (0.5f + (float)index / (float)(width ? width : 1));
  }
  mlx_array array = mlx_array_new_data(values, &width, 1, MLX_FLOAT32);
  free(values);
  return array;
}

/* Evaluates both and compares dtype, shape and bytes. */
static bool same_bits(mlx_array actual, mlx_array expected) {
  if (mlx_array_eval(actual) != 0 || mlx_array_eval(expected) != 0) {
    return false;
  }
  if (mlx_array_dtype(actual) != mlx_array_dtype(expected) ||
      mlx_array_ndim(actual) != mlx_array_ndim(expected)) {
    return false;
  }
  size_t rank = mlx_array_ndim(actual);
  if (rank > 0 &&
      memcmp(mlx_array_shape(actual), mlx_array_shape(expected), rank * sizeof(int)) != 0) {
    return false;
  }
  size_t bytes = mlx_array_nbytes(actual);
  if (bytes == 0) {
    return true;
  }
  const void* actual_data = mlx_array_dtype(actual) == MLX_FLOAT64
                                ? (const void*)mlx_array_data_float64(actual)
                                : (const void*)mlx_array_data_float32(actual);
  const void* expected_data = mlx_array_dtype(expected) == MLX_FLOAT64
                                  ? (const void*)mlx_array_data_float64(expected)
                                  : (const void*)mlx_array_data_float32(expected);
  return actual_data != NULL && expected_data != NULL &&
         memcmp(actual_data, expected_data, bytes) == 0;
}

/* rms_norm(input, weight, eps) on the default stream: the composed path.
 * A failure leaves the result empty, which same_bits reports; MLX's message
 * goes to the composite's handler, which keeps it for its own calls only. */
static mlx_array composed(mlx_array input, mlx_array weight, float eps) {
  mlx_device device = mlx_device_new();
  mlx_stream stream = mlx_stream_new();
  mlx_array result = mlx_array_new();
  if (mlx_get_default_device(&device) != 0 ||
      mlx_get_default_stream(&stream, device) != 0 ||
      mlx_fast_rms_norm(&result, input, weight, eps, stream) != 0) {
    fprintf(stderr, "composed rms_norm failed\n");
  }
  mlx_stream_free(stream);
  mlx_device_free(device);
  return result;
}

/* One apply, checked against the composed path for `eps` and (where the
 * outputs are not empty) against `other_eps`, which must differ. */
static void check_apply(mlx_dualnorm_compiled_dual_head_norm* norm, float eps, float other_eps,
                        mlx_array queries, mlx_array keys, mlx_array query_weight,
                        mlx_array key_weight, const char* context) {
  mlx_vector_array outputs = mlx_vector_array_new();
  mlx_dualnorm_error error = {MLX_DUALNORM_OK, "", ""};
  int status = mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, keys,
                                                          query_weight, key_weight, &error);
  CHECK(status == MLX_DUALNORM_OK, "%s: apply failed: [%s] %s", context, error.operation,
        error.description);
  CHECK(mlx_vector_array_size(outputs) == 2, "%s: %zu outputs", context,
        mlx_vector_array_size(outputs));
  if (status == MLX_DUALNORM_OK && mlx_vector_array_size(outputs) == 2) {
    const mlx_array inputs[2] = {queries, keys};
    const mlx_array weights[2] = {query_weight, key_weight};
    for (size_t side = 0; side < 2; ++side) {
      mlx_array output = mlx_array_new();
      mlx_vector_array_get(&output, outputs, side);
      mlx_array expected = composed(inputs[side], weights[side], eps);
      CHECK(same_bits(output, expected), "%s: side %zu differs from eps %g", context, side,
            (double)eps);
      if (other_eps != eps && mlx_array_size(output) > 1) {
        mlx_array wrong = composed(inputs[side], weights[side], other_eps);
        CHECK(!same_bits(output, wrong), "%s: side %zu equals the output of eps %g", context,
              side, (double)other_eps);
        mlx_array_free(wrong);
      }
      mlx_array_free(expected);
      mlx_array_free(output);
    }
  }
  mlx_vector_array_free(outputs);
}

static mlx_dualnorm_compiled_dual_head_norm* new_norm(float eps, mlx_dualnorm_mode mode) {
  mlx_dualnorm_compiled_dual_head_norm* norm = NULL;
  mlx_dualnorm_error error = {MLX_DUALNORM_OK, "", ""};
  int status = mlx_dualnorm_compiled_dual_head_norm_new(&norm, eps, mode, &error);
  CHECK(status == MLX_DUALNORM_OK && norm != NULL, "new(%g) failed: [%s] %s", (double)eps,
        error.operation, error.description);
  return norm;
}

/* ---- single-threaded scenarios ---------------------------------------- */

static void test_interleaved_objects_and_retraces(mlx_dualnorm_mode mode) {
  const int query_shape[] = {2, 4, 64};
  const int key_shape[] = {2, 2, 64};
  const int query_shape4[] = {1, 2, 4, 64};
  const int many_rows[] = {64, 64};
  mlx_array queries = small_float32(query_shape, 3, 1);
  mlx_array keys = small_float32(key_shape, 3, 2);
  mlx_array queries4 = small_float32(query_shape4, 4, 3);
  mlx_array queries64 = small_float64(query_shape, 3, 4);
  mlx_array keys64 = small_float64(key_shape, 3, 5);
  mlx_array large = small_float32(many_rows, 2, 6);
  mlx_array weight = weight_float32(64, 1.0f);
  mlx_array no_weight = mlx_array_new();

  mlx_dualnorm_compiled_dual_head_norm* norms[EPSILON_COUNT];
  for (int index = 0; index < EPSILON_COUNT; ++index) {
    norms[index] = new_norm(EPSILONS[index], mode);
  }
  /* First calls in reverse construction order, then every layout. */
  for (int index = EPSILON_COUNT - 1; index >= 0; --index) {
    check_apply(norms[index], EPSILONS[index], EPSILONS[(index + 1) % EPSILON_COUNT], queries,
                keys, no_weight, no_weight, "first call");
  }
  const mlx_array layouts[4][2] = {
      {no_weight, no_weight}, {weight, no_weight}, {no_weight, weight}, {weight, weight}};
  for (int round = 0; round < 2; ++round) {
    for (int layout = 0; layout < 4; ++layout) {
      for (int index = 0; index < EPSILON_COUNT; ++index) {
        int other = (index + 1) % EPSILON_COUNT;
        check_apply(norms[index], EPSILONS[index], EPSILONS[other], queries, keys,
                    layouts[layout][0], layouts[layout][1], "layout");
      }
    }
  }
  /* Retraces: rank change, dtype change, many rows (uncompiled builder). */
  for (int index = 0; index < EPSILON_COUNT; ++index) {
    int other = (index + 2) % EPSILON_COUNT;
    check_apply(norms[index], EPSILONS[index], EPSILONS[other], queries4, keys, no_weight,
                no_weight, "rank change");
    check_apply(norms[index], EPSILONS[index], EPSILONS[other], queries64, keys64, no_weight,
                no_weight, "dtype change");
    check_apply(norms[index], EPSILONS[index], EPSILONS[other], large, keys, weight, no_weight,
                "many rows");
    check_apply(norms[index], EPSILONS[index], EPSILONS[other], queries, keys, no_weight,
                no_weight, "original graph");
  }
  for (int index = 0; index < EPSILON_COUNT; ++index) {
    mlx_dualnorm_compiled_dual_head_norm_free(norms[index]);
  }
  mlx_array_free(queries);
  mlx_array_free(keys);
  mlx_array_free(queries4);
  mlx_array_free(queries64);
  mlx_array_free(keys64);
  mlx_array_free(large);
  mlx_array_free(weight);
}

static void test_degenerate_widths(void) {
  mlx_dualnorm_compiled_dual_head_norm* norm = new_norm(1e-5f, MLX_DUALNORM_MODE_COMPILED);
  const int shapes[][3] = {{3, 1, 0}, {2, 2, 1}, {2, 0, 0}, {0, 8, 0}, {2, 3, 0}};
  const int ranks[] = {2, 3, 2, 2, 3};
  const int key_shape[] = {2, 8};
  mlx_array keys = small_float32(key_shape, 2, 7);
  mlx_array no_weight = mlx_array_new();
  for (size_t case_index = 0; case_index < sizeof ranks / sizeof ranks[0]; ++case_index) {
    mlx_array queries = small_float32(shapes[case_index], ranks[case_index], 8);
    int width = shapes[case_index][ranks[case_index] - 1];
    mlx_array weight = weight_float32(width, 1.5f);
    check_apply(norm, 1e-5f, 1e-5f, queries, keys, no_weight, no_weight, "degenerate width");
    check_apply(norm, 1e-5f, 1e-5f, queries, keys, weight, no_weight, "degenerate width, weighted");
    mlx_array_free(weight);
    mlx_array_free(queries);
  }
  mlx_array_free(keys);
  mlx_dualnorm_compiled_dual_head_norm_free(norm);
}

/* A failed call: its return value, and the record it filled (the same
 * status, the operation, a description holding `fragment`). */
static void expect_failure(int status, const mlx_dualnorm_error* error,
                           mlx_dualnorm_status expected, const char* operation,
                           const char* fragment, const char* context) {
  CHECK(status == (int)expected, "%s: status %d, expected %d", context, status, (int)expected);
  CHECK(error->status == expected, "%s: recorded status %d, expected %d", context,
        (int)error->status, (int)expected);
  CHECK(error->operation != NULL && strcmp(error->operation, operation) == 0,
        "%s: operation '%s', expected '%s'", context,
        error->operation != NULL ? error->operation : "(null)", operation);
  CHECK(strstr(error->description, fragment) != NULL, "%s: description '%s' lacks '%s'",
        context, error->description, fragment);
}

/* The raw mlx-c messages of the calls in flight, caught by the test's own
 * handler (installed around raw calls only: the composite needs its own). */
static char raw_mlx_message[1024];

static void keep_raw_mlx_message(const char* message, void* data) {
  (void)data;
  snprintf(raw_mlx_message, sizeof raw_mlx_message, "%s", message);
}

/* mlx-c failures outside the composite: non-zero returns and messages to
 * the installed handler, and the process carries on. */
static void test_raw_mlx_c_failures(void) {
  mlx_set_error_handler(keep_raw_mlx_message, NULL, NULL);
  mlx_array empty = mlx_array_new();
  mlx_array item = mlx_array_new();
  mlx_vector_array vector = mlx_vector_array_new();
  raw_mlx_message[0] = '\0';
  CHECK(mlx_array_eval(empty) != 0, "eval of an empty handle succeeded");
  CHECK(strstr(raw_mlx_message, "mlx_array") != NULL, "raw failure not reported: '%s'",
        raw_mlx_message);
  raw_mlx_message[0] = '\0';
  CHECK(mlx_vector_array_get(&item, vector, 5) != 0, "out-of-range get succeeded");
  CHECK(raw_mlx_message[0] != '\0', "out-of-range get reported nothing");
  mlx_array_free(item);
  mlx_vector_array_free(vector);
  mlx_dualnorm_install_error_handler();
}

static void test_invalid_arguments_and_lifecycle(void) {
  const int shape[] = {2, 8};
  const int scalar_shape[1] = {0};
  mlx_array queries = small_float32(shape, 2, 9);
  mlx_array short_weight = weight_float32(7, 1.0f);
  mlx_array scalar = mlx_array_new_data((float[]){1.0f}, scalar_shape, 0, MLX_FLOAT32);
  const int32_t integers[16] = {0};
  mlx_array integer_queries = mlx_array_new_data(integers, shape, 2, MLX_INT32);
  mlx_array empty = mlx_array_new();
  mlx_vector_array outputs = mlx_vector_array_new();

  mlx_dualnorm_error error;
  mlx_dualnorm_compiled_dual_head_norm* rejected = NULL;
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_new(&rejected, NAN, MLX_DUALNORM_MODE_AUTO,
                                                          &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, COMPILE_OPERATION, "finite", "NaN eps");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_new(&rejected, -1.0, MLX_DUALNORM_MODE_AUTO,
                                                          &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, COMPILE_OPERATION, ">= 0", "negative eps");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_new(&rejected, 1e39, MLX_DUALNORM_MODE_AUTO,
                                                          &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, COMPILE_OPERATION, "float32",
                 "eps beyond float32");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_new(NULL, 1e-5, MLX_DUALNORM_MODE_AUTO,
                                                          &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, COMPILE_OPERATION, "NULL", "NULL result");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_new(&rejected, 1e-5,
                                                          (mlx_dualnorm_mode)42, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, COMPILE_OPERATION, "unknown mode",
                 "unknown mode");
  CHECK(mlx_dualnorm_compiled_dual_head_norm_new(&rejected, NAN, MLX_DUALNORM_MODE_AUTO, NULL) ==
            MLX_DUALNORM_INVALID_ARGUMENT,
        "a NULL error record changed the status");
  CHECK(rejected == NULL, "a rejected new set the result");

  mlx_dualnorm_compiled_dual_head_norm* norm = new_norm(1e-5f, MLX_DUALNORM_MODE_AUTO);
  CHECK(mlx_dualnorm_compiled_dual_head_norm_mode(norm) == MLX_DUALNORM_MODE_COMPILED,
        "AUTO without a fused backend resolved to %d",
        (int)mlx_dualnorm_compiled_dual_head_norm_mode(norm));
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, empty, queries, empty,
                                                            empty, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_OPERATION, "empty array handle",
                 "empty queries");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, scalar, empty,
                                                            empty, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_OPERATION, "at least 1 dimension",
                 "0-d keys");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, queries,
                                                            short_weight, empty, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_OPERATION, "7 elements",
                 "short weight");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, queries,
                                                            scalar, empty, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_OPERATION, "1 dimension",
                 "0-d weight");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, integer_queries,
                                                            queries, empty, empty, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_OPERATION, "int32",
                 "int32 queries");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(NULL, norm, queries, queries, empty,
                                                            empty, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_OPERATION, "NULL",
                 "NULL result vector");
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, NULL, queries, queries,
                                                            empty, empty, &error),
                 &error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_OPERATION, "NULL", "NULL object");
  CHECK(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, queries, short_weight,
                                                   empty, NULL) == MLX_DUALNORM_INVALID_ARGUMENT,
        "a NULL error record changed the status of a rejected apply");
  CHECK(mlx_vector_array_size(outputs) == 0, "a rejected apply filled the outputs");
  check_apply(norm, 1e-5f, 1e-5f, queries, queries, empty, empty, "after invalid arguments");

  CHECK(mlx_dualnorm_compiled_dual_head_norm_close(norm, &error) == MLX_DUALNORM_OK,
        "close failed: [%s] %s", error.operation, error.description);
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, queries,
                                                            empty, empty, &error),
                 &error, MLX_DUALNORM_CLOSED, APPLY_OPERATION, "closed", "apply after close");
  CHECK(mlx_dualnorm_compiled_dual_head_norm_close(norm, NULL) == MLX_DUALNORM_OK,
        "second close failed");
  CHECK(mlx_dualnorm_compiled_dual_head_norm_epsilon(norm) == 1e-5f, "eps lost at close");
  mlx_dualnorm_compiled_dual_head_norm_free(norm);
  mlx_dualnorm_compiled_dual_head_norm_free(NULL);
  expect_failure(mlx_dualnorm_compiled_dual_head_norm_close(NULL, &error), &error,
                 MLX_DUALNORM_INVALID_ARGUMENT, CLOSE_OPERATION, "NULL", "close NULL");

  mlx_vector_array_free(outputs);
  mlx_array_free(queries);
  mlx_array_free(short_weight);
  mlx_array_free(scalar);
  mlx_array_free(integer_queries);
}

/* ---- threads ---------------------------------------------------------- */

enum { CALLER_THREADS = 4, BUILDER_THREADS = 2, ROUNDS = 40 };

static mlx_dualnorm_compiled_dual_head_norm* shared_norms[EPSILON_COUNT];

static void* call_shared_objects(void* argument) {
  uintptr_t seed = (uintptr_t)argument;
  const int query_shape[] = {2, 4, 64};
  const int key_shape[] = {2, 2, 64};
  mlx_array queries = small_float32(query_shape, 3, (uint32_t)seed + 10);
  mlx_array keys = small_float32(key_shape, 3, (uint32_t)seed + 20);
  mlx_array no_weight = mlx_array_new();
  for (int round = 0; round < ROUNDS; ++round) {
    int index = (int)((seed + (uintptr_t)round) % EPSILON_COUNT);
    check_apply(shared_norms[index], EPSILONS[index], EPSILONS[(index + 1) % EPSILON_COUNT],
                queries, keys, no_weight, no_weight, "caller thread");
  }
  mlx_array_free(queries);
  mlx_array_free(keys);
  return NULL;
}

static void* build_and_free_objects(void* argument) {
  uintptr_t seed = (uintptr_t)argument;
  const int query_shape[] = {2, 4, 64};
  mlx_array queries = small_float32(query_shape, 3, (uint32_t)seed + 30);
  mlx_array no_weight = mlx_array_new();
  const float own_epsilons[2] = {3e-3f, 3e-5f};
  for (int round = 0; round < ROUNDS / 2; ++round) {
    float eps = own_epsilons[round % 2];
    mlx_dualnorm_compiled_dual_head_norm* norm = new_norm(eps, MLX_DUALNORM_MODE_AUTO);
    check_apply(norm, eps, own_epsilons[(round + 1) % 2], queries, queries, no_weight, no_weight,
                "builder thread");
    mlx_dualnorm_compiled_dual_head_norm_free(norm);
  }
  mlx_array_free(queries);
  return NULL;
}

static void test_threads(void) {
  for (int index = 0; index < EPSILON_COUNT; ++index) {
    shared_norms[index] = new_norm(EPSILONS[index], MLX_DUALNORM_MODE_AUTO);
  }
  pthread_t threads[CALLER_THREADS + BUILDER_THREADS];
  for (uintptr_t index = 0; index < CALLER_THREADS; ++index) {
    pthread_create(&threads[index], NULL, call_shared_objects, (void*)index);
  }
  for (uintptr_t index = 0; index < BUILDER_THREADS; ++index) {
    pthread_create(&threads[CALLER_THREADS + index], NULL, build_and_free_objects, (void*)index);
  }
  for (int index = 0; index < CALLER_THREADS + BUILDER_THREADS; ++index) {
    pthread_join(threads[index], NULL);
  }
  for (int index = 0; index < EPSILON_COUNT; ++index) {
    mlx_dualnorm_compiled_dual_head_norm_free(shared_norms[index]);
  }
}

/* ---- the norm + RoPE's call struct ---------------------------------------- */

static const char ROPE_OPERATION[] = "dual_head_norm_rope";
enum { ROPE_DIMS = 32, ROPE_WRITE_OFFSET = 3 };

/* Compares two result vectors of `count` arrays each, array by array. */
static void check_same_outputs(mlx_vector_array actual, mlx_vector_array expected,
                               size_t count, const char* context) {
  CHECK(mlx_vector_array_size(actual) == count, "%s: %zu outputs, expected %zu", context,
        mlx_vector_array_size(actual), count);
  CHECK(mlx_vector_array_size(expected) == count, "%s: the older entry gave %zu outputs",
        context, mlx_vector_array_size(expected));
  for (size_t index = 0; index < count && index < mlx_vector_array_size(actual) &&
                         index < mlx_vector_array_size(expected);
       ++index) {
    mlx_array actual_array = mlx_array_new();
    mlx_array expected_array = mlx_array_new();
    CHECK(mlx_vector_array_get(&actual_array, actual, index) == 0 &&
              mlx_vector_array_get(&expected_array, expected, index) == 0 &&
              same_bits(actual_array, expected_array),
          "%s: output %zu differs", context, index);
    mlx_array_free(actual_array);
    mlx_array_free(expected_array);
  }
}

static void test_rope_call_struct(void) {
  const int query_shape[4] = {1, 1, 4, 64};
  const int key_shape[4] = {1, 1, 2, 64};
  const int buffer_shape[4] = {1, 2, 8, 64};
  int32_t offset_value = 5;
  mlx_array queries = small_float32(query_shape, 4, 41);
  mlx_array keys = small_float32(key_shape, 4, 42);
  mlx_array values = small_float32(key_shape, 4, 43);
  mlx_array key_cache = small_float32(buffer_shape, 4, 44);
  mlx_array value_cache = small_float32(buffer_shape, 4, 45);
  mlx_array query_weight = weight_float32(64, 1.5f);
  mlx_array key_weight = weight_float32(64, 0.5f);
  mlx_array offset = mlx_array_new_data(&offset_value, NULL, 0, MLX_INT32);
  mlx_array no_freqs = mlx_array_new();
  mlx_dualnorm_rope_parameters rope = {.dims = ROPE_DIMS, .base = 10000.0f, .scale = 1.0f};
  mlx_dualnorm_dual_head_norm_rope* norm_rope = NULL;
  mlx_dualnorm_error error = {0};
  CHECK(mlx_dualnorm_dual_head_norm_rope_new(&norm_rope, 1e-5, rope, MLX_DUALNORM_MODE_COMPILED,
                                             &error) == MLX_DUALNORM_OK,
        "norm + RoPE construction: %s", error.description);
  mlx_dualnorm_cache_write write = {values, key_cache, value_cache, ROPE_WRITE_OFFSET, false};
  mlx_dualnorm_dual_head_norm_rope_call call = {
      .struct_size = sizeof call,
      .inputs = {queries, keys, query_weight, key_weight, offset, no_freqs},
      .cache_write = NULL,
  };
  for (int route = 0; norm_rope != NULL && route < 3; ++route) {
    write.fetch = route == 2;
    call.cache_write = route == 0 ? NULL : &write;
    mlx_vector_array through_struct = mlx_vector_array_new();
    mlx_vector_array through_arguments = mlx_vector_array_new();
    int struct_status =
        mlx_dualnorm_dual_head_norm_rope_apply_call(&through_struct, norm_rope, &call, &error);
    int arguments_status =
        route == 0 ? mlx_dualnorm_dual_head_norm_rope_apply(&through_arguments, norm_rope,
                                                            queries, keys, query_weight,
                                                            key_weight, offset, &error)
                   : mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
                         &through_arguments, norm_rope, queries, keys, values, query_weight,
                         key_weight, offset, no_freqs, key_cache, value_cache,
                         ROPE_WRITE_OFFSET, write.fetch, &error);
    CHECK(struct_status == MLX_DUALNORM_OK && arguments_status == MLX_DUALNORM_OK,
          "route %d: statuses %d and %d (%s)", route, struct_status, arguments_status,
          error.description);
    size_t count = route == 0   ? MLX_DUALNORM_ROPE_OUTPUT_COUNT
                   : route == 1 ? MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT
                                : MLX_DUALNORM_CACHE_FETCH_OUTPUT_COUNT;
    check_same_outputs(through_struct, through_arguments, count, "apply_call");
    mlx_vector_array_free(through_struct);
    mlx_vector_array_free(through_arguments);
  }
  /* One field short of the first version, then no size at all. */
  const size_t too_small[2] = {sizeof call - sizeof call.cache_write, 0};
  for (int index = 0; norm_rope != NULL && index < 2; ++index) {
    call.struct_size = too_small[index];
    mlx_vector_array untouched = mlx_vector_array_new();
    int status = mlx_dualnorm_dual_head_norm_rope_apply_call(&untouched, norm_rope, &call,
                                                             &error);
    expect_failure(status, &error, MLX_DUALNORM_INVALID_ARGUMENT, ROPE_OPERATION,
                   "struct_size", "a struct_size below the first version's");
    CHECK(mlx_vector_array_size(untouched) == 0, "a refused call left %zu outputs",
          mlx_vector_array_size(untouched));
    mlx_vector_array_free(untouched);
  }
  mlx_dualnorm_dual_head_norm_rope_free(norm_rope);
  const mlx_array owned[] = {queries,    keys,         values,     key_cache,
                             value_cache, query_weight, key_weight, offset};
  for (size_t index = 0; index < sizeof owned / sizeof owned[0]; ++index) {
    mlx_array_free(owned[index]);
  }
}

/* rope(x.transpose(0, 2, 1, 3)) by mlx-c's own calls on the default stream:
 * the composed path of an object without norms. A new handle (empty on
 * failure, which same_bits reports). */
static mlx_array composed_rotation(mlx_array input, mlx_array offset) {
  static const int head_major[4] = {0, 2, 1, 3};
  const mlx_optional_float base = {.value = 10000.0f, .has_value = true};
  mlx_device device = mlx_device_new();
  mlx_stream stream = mlx_stream_new();
  mlx_array transposed = mlx_array_new();
  mlx_array rotated = mlx_array_new();
  if (mlx_get_default_device(&device) != 0 || mlx_get_default_stream(&stream, device) != 0 ||
      mlx_transpose_axes(&transposed, input, head_major, 4, stream) != 0 ||
      mlx_fast_rope_dynamic(&rotated, transposed, ROPE_DIMS, false, base, 1.0f, offset,
                            mlx_array_new(), stream) != 0) {
    mlx_array_free(rotated);
    rotated = mlx_array_new();
  }
  mlx_array_free(transposed);
  mlx_stream_free(stream);
  mlx_device_free(device);
  return rotated;
}

static void test_rope_without_norms(void) {
  const int query_shape[4] = {2, 1, 4, 64};
  const int key_shape[4] = {2, 1, 2, 64};
  int32_t offset_value = 9;
  mlx_array queries = small_float32(query_shape, 4, 51);
  mlx_array keys = small_float32(key_shape, 4, 52);
  mlx_array weight = weight_float32(64, 1.0f);
  mlx_array offset = mlx_array_new_data(&offset_value, NULL, 0, MLX_INT32);
  mlx_array no_array = mlx_array_new();
  mlx_dualnorm_rope_parameters rope = {.dims = ROPE_DIMS, .base = 10000.0f, .scale = 1.0f};
  mlx_dualnorm_dual_head_norm_rope* rotation = NULL;
  mlx_dualnorm_error error = {0};
  CHECK(mlx_dualnorm_dual_head_norm_rope_new_without_norms(
            &rotation, rope, MLX_DUALNORM_MODE_COMPILED, &error) == MLX_DUALNORM_OK,
        "construction without norms: %s", error.description);
  CHECK(rotation != NULL && !mlx_dualnorm_dual_head_norm_rope_normalizes(rotation) &&
            isnan(mlx_dualnorm_dual_head_norm_rope_epsilon(rotation)),
        "an object without norms reports norms or an epsilon");
  mlx_vector_array outputs = mlx_vector_array_new();
  mlx_vector_array expected = mlx_vector_array_new();
  mlx_array expected_arrays[2] = {composed_rotation(queries, offset),
                                  composed_rotation(keys, offset)};
  if (rotation != NULL &&
      mlx_dualnorm_dual_head_norm_rope_apply(&outputs, rotation, queries, keys, no_array,
                                             no_array, offset, &error) == MLX_DUALNORM_OK &&
      mlx_vector_array_set_data(&expected, expected_arrays, 2) == 0) {
    check_same_outputs(outputs, expected, MLX_DUALNORM_ROPE_OUTPUT_COUNT, "without norms");
  } else {
    CHECK(false, "the call without norms failed: %s", error.description);
  }
  mlx_vector_array untouched = mlx_vector_array_new();
  int status = rotation == NULL ? MLX_DUALNORM_INVALID_ARGUMENT
                                : mlx_dualnorm_dual_head_norm_rope_apply(
                                      &untouched, rotation, queries, keys, weight, no_array,
                                      offset, &error);
  expect_failure(status, &error, MLX_DUALNORM_INVALID_ARGUMENT, ROPE_OPERATION, "without norms",
                 "a weight given to an object without norms");
  mlx_vector_array_free(untouched);
  mlx_vector_array_free(outputs);
  mlx_vector_array_free(expected);
  mlx_dualnorm_dual_head_norm_rope_free(rotation);
  const mlx_array owned[] = {queries, keys, weight, offset, expected_arrays[0],
                             expected_arrays[1]};
  for (size_t index = 0; index < sizeof owned / sizeof owned[0]; ++index) {
    mlx_array_free(owned[index]);
  }
}

int main(void) {
  mlx_dualnorm_install_error_handler();
  test_interleaved_objects_and_retraces(MLX_DUALNORM_MODE_COMPILED);
  test_interleaved_objects_and_retraces(MLX_DUALNORM_MODE_COMPOSED);
  test_degenerate_widths();
  test_invalid_arguments_and_lifecycle();
  test_raw_mlx_c_failures();
  test_threads();
  test_rope_call_struct();
  test_rope_without_norms();
  printf("dual_head_norm_c_test: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
