/* Normalizing a layer's query and key heads with one compiled MLX graph,
 * from plain C.
 *
 * Builds bfloat16 queries (1, 1, 16, 128) and keys (1, 1, 8, 128), applies
 * the compiled dual head norm without and with scale weights, and checks
 * that both outputs have exactly the bits of two mlx_fast_rms_norm calls on
 * the default stream. Then shows what a rejected call reports. Exits 1 on
 * any mismatch.
 *
 * Build it against libmlx_dualnorm installed to PREFIX (docs/c-library.md:
 * one command builds and installs it over an mlx-c install, upstream's from
 * scripts/build_mlx_c.sh or the bundled subset's from
 * scripts/build_subset_mlx_c.sh). From the repository root, with CMake
 * (examples/CMakeLists.txt: find_package(mlx_dualnorm)):
 *
 * cmake -S examples -B build/example -DCMAKE_PREFIX_PATH="$PREFIX" && cmake --build build/example
 *
 * or with pkg-config, with only a C compiler:
 *
 * cc -std=c11 examples/dual_head_norm_example.c $(PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig" pkg-config --cflags --libs mlx_dualnorm) -o dual_head_norm_example
 *
 * No -lmlx: libmlxc finds the MLX wheel's libmlx.so through its own rpath.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dual_head_norm.h"

enum { HEAD_DIM = 128, QUERY_HEADS = 16, KEY_HEADS = 8 };

/* float32 to bfloat16 bits, rounding to nearest even (finite values). */
static uint16_t bfloat16_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

/* A bfloat16 array of `shape` (at most QUERY_HEADS * HEAD_DIM elements)
 * filled with deterministic values in [offset, offset + 1). MLX copies the
 * data; the handle is empty if MLX fails, and the apply then says so. */
static mlx_array bfloat16_array(const int* shape, int rank, float offset) {
  uint16_t values[QUERY_HEADS * HEAD_DIM];
  int count = 1;
  for (int axis = 0; axis < rank; ++axis) {
    count *= shape[axis];
  }
  for (int index = 0; index < count; ++index) {
    values[index] = bfloat16_bits(offset + (float)((index * 37) % 101) / 101.0f);
  }
  return mlx_array_new_data(values, shape, rank, MLX_BFLOAT16);
}

/* Both arrays evaluated, same dtype and size, same bytes. */
static bool same_bits(mlx_array actual, mlx_array expected) {
  if (mlx_array_eval(actual) != 0 || mlx_array_eval(expected) != 0 ||
      mlx_array_dtype(actual) != mlx_array_dtype(expected) ||
      mlx_array_nbytes(actual) != mlx_array_nbytes(expected)) {
    return false;
  }
  const uint8_t* actual_bytes = mlx_array_data_uint8(actual);
  const uint8_t* expected_bytes = mlx_array_data_uint8(expected);
  return actual_bytes != NULL && expected_bytes != NULL &&
         memcmp(actual_bytes, expected_bytes, mlx_array_nbytes(actual)) == 0;
}

/* Whether `normalized` has the bits of mlx_fast_rms_norm(input, weight, eps)
 * on the default stream: the two-call path the dual head norm replaces. */
static bool matches_rms_norm(mlx_array normalized, mlx_array input, mlx_array weight, float eps) {
  mlx_device device = mlx_device_new();
  mlx_stream stream = mlx_stream_new();
  mlx_array expected = mlx_array_new();
  bool same = mlx_get_default_device(&device) == 0 &&
              mlx_get_default_stream(&stream, device) == 0 &&
              mlx_fast_rms_norm(&expected, input, weight, eps, stream) == 0 &&
              same_bits(normalized, expected);
  mlx_array_free(expected);
  mlx_stream_free(stream);
  mlx_device_free(device);
  return same;
}

/* Applies the dual head norm and compares both outputs; prints one line. */
static bool check_parity(mlx_dualnorm_compiled_dual_head_norm* norm, const char* label,
                         mlx_array queries, mlx_array keys, mlx_array query_weight,
                         mlx_array key_weight) {
  mlx_dualnorm_error error;
  mlx_vector_array outputs = mlx_vector_array_new();
  mlx_array normalized_queries = mlx_array_new();
  mlx_array normalized_keys = mlx_array_new();
  float eps = mlx_dualnorm_compiled_dual_head_norm_epsilon(norm);
  bool same = false;
  if (mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, keys, query_weight,
                                                 key_weight, &error) != MLX_DUALNORM_OK) {
    printf("%s: [%s] %s\n", label, error.operation, error.description);
  } else if (mlx_vector_array_size(outputs) == 2 &&
             mlx_vector_array_get(&normalized_queries, outputs, 0) == 0 &&
             mlx_vector_array_get(&normalized_keys, outputs, 1) == 0) {
    same = matches_rms_norm(normalized_queries, queries, query_weight, eps) &&
           matches_rms_norm(normalized_keys, keys, key_weight, eps);
    printf("%s: %s\n", label,
           same ? "queries and keys bit-identical to mlx_fast_rms_norm" : "MISMATCH");
  }
  mlx_array_free(normalized_keys);
  mlx_array_free(normalized_queries);
  mlx_vector_array_free(outputs);
  return same;
}

/* A query weight of 64 elements for rows of 128: rejected before MLX runs,
 * with the reason in the caller's error record. */
static bool check_rejected_weight(mlx_dualnorm_compiled_dual_head_norm* norm,
                                  mlx_array queries, mlx_array keys) {
  const int short_shape[1] = {HEAD_DIM / 2};
  mlx_array short_weight = bfloat16_array(short_shape, 1, 1.0f);
  mlx_array no_weight = mlx_array_new();
  mlx_vector_array outputs = mlx_vector_array_new();
  mlx_dualnorm_error error;
  int status = mlx_dualnorm_compiled_dual_head_norm_apply(&outputs, norm, queries, keys,
                                                          short_weight, no_weight, &error);
  if (status != MLX_DUALNORM_OK) {
    printf("rejected: status %d [%s] %s\n", status, error.operation, error.description);
  }
  mlx_vector_array_free(outputs);
  mlx_array_free(short_weight);
  return status == MLX_DUALNORM_INVALID_ARGUMENT;
}

int main(void) {
  /* Before any MLX call: mlx-c's default handler exits the process. */
  mlx_dualnorm_install_error_handler();

  mlx_dualnorm_error error;
  mlx_dualnorm_compiled_dual_head_norm* norm = NULL;
  if (mlx_dualnorm_compiled_dual_head_norm_new(&norm, 1e-6, MLX_DUALNORM_MODE_AUTO, &error) !=
      MLX_DUALNORM_OK) {
    fprintf(stderr, "[%s] %s\n", error.operation, error.description);
    return 1;
  }
  /* AUTO: the fused CUDA mode where one is registered, else compiled. */
  printf("mode: %s\n", mlx_dualnorm_compiled_dual_head_norm_mode(norm) == MLX_DUALNORM_MODE_FUSED
                            ? "fused"
                            : "compiled");
  const int query_shape[4] = {1, 1, QUERY_HEADS, HEAD_DIM};
  const int key_shape[4] = {1, 1, KEY_HEADS, HEAD_DIM};
  const int weight_shape[1] = {HEAD_DIM};
  mlx_array queries = bfloat16_array(query_shape, 4, -0.5f);
  mlx_array keys = bfloat16_array(key_shape, 4, -0.25f);
  mlx_array query_weight = bfloat16_array(weight_shape, 1, 0.5f);
  mlx_array key_weight = bfloat16_array(weight_shape, 1, 0.75f);
  mlx_array no_weight = mlx_array_new();

  int mismatches = 0;
  mismatches += !check_parity(norm, "weightless", queries, keys, no_weight, no_weight);
  mismatches += !check_parity(norm, "weighted", queries, keys, query_weight, key_weight);
  bool rejected = check_rejected_weight(norm, queries, keys);
  printf("summary: 2 parity checks, %d mismatched; short weight %s\n", mismatches,
         rejected ? "rejected" : "NOT rejected");

  mlx_array_free(key_weight);
  mlx_array_free(query_weight);
  mlx_array_free(keys);
  mlx_array_free(queries);
  mlx_dualnorm_compiled_dual_head_norm_free(norm);
  return mismatches == 0 && rejected ? 0 : 1;
}
