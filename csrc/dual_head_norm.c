/* Epsilon-specialized compiled composite fusing the gated-delta head
 * normalizations.
 *
 * The query/key head RMS normalizations of the gated-delta prework ran as
 * two graph builds per layer; one dual-output replay of a shapeless compiled
 * graph produces both. Every primitive and its order match the composed
 * path: the builder calls mlx_fast_rms_norm on each input exactly as two
 * separate calls would, so MLX emits the same kernels over the same inputs.
 *
 * Graph builders are plain function pointers that cannot capture the RMS
 * epsilon, and mlx_fast_rms_norm bakes its epsilon into the graph at trace
 * time, so the epsilon rides in a process-wide slot. MLX traces at the first
 * APPLY, not at compile, and traces again whenever the compile cache misses
 * (a dtype or rank change, a new thread, a new default stream, or on every
 * call when compilation is disabled). Each apply therefore stores its own
 * object's epsilon in the slot and holds the trace lock across the apply, so
 * any trace that apply triggers reads that object's epsilon, whatever other
 * objects and threads do meanwhile. A cache hit does not read the slot.
 *
 * In fused mode, supported inputs skip the graph: one CUDA kernel launch
 * (fused/) takes the epsilon as a kernel argument, so neither the slot nor
 * the lock is involved.
 *
 * Each object compiles under ids of its own, never reused, with its
 * epsilon's bits as a compile constant: MLX's compile cache is per thread
 * and closing erases only the closing thread's entries, so a reused id
 * (MLX's default, the closure's address) could let a new object replay an
 * old object's trace, with the old epsilon, on another thread.
 *
 * The compiled graph pays off at decode sizes only: on CPU, MLX fuses the
 * fallback rms_norm ops into one generic kernel that is 1.6-2x slower than
 * the composed ops beyond a few dozen rows (measured at (1,512,16,128):
 * docs/performance.md). Calls with more than COMPILED_GRAPH_MAX_ROWS rows
 * in all take the uncompiled builder, which is the composed graph.
 *
 * Rows of width 0 or 1 take the uncompiled builder too:
 * MLX 0.32.4's shapeless compile returns the wrong shape for width 0 and
 * crashes in its CPU sum for width 1 at rank >= 2.
 *
 * A shapeless replay skips rms_norm's argument checks (it only recomputes
 * output shapes), so a weight whose length is not the inputs' width would be
 * read out of bounds without a word. The apply checks, on every call, the
 * preconditions rms_norm checks at trace time, and reports them as invalid
 * arguments.
 */
#include "dual_head_norm.h"
#include "fused/fused_dual_head_norm.h"

#include <math.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char COMPILE_DUAL_HEAD_NORM_OPERATION[] =
    "compile the shapeless MLX dual head norm graph";
static const char APPLY_DUAL_HEAD_NORM_OPERATION[] =
    "apply the compiled MLX dual head norm";
static const char CLOSE_DUAL_HEAD_NORM_OPERATION[] =
    "close the compiled MLX dual head norm";
static const char MLX_C_CALL_OPERATION[] = "call the mlx-c API";

/* ---- The calling thread's error record ---------------------------------- */

enum { ERROR_DESCRIPTION_CAPACITY = 1024 };

typedef struct last_error_record {
  mlx_dualnorm_status status;
  const char* operation;
  char description[ERROR_DESCRIPTION_CAPACITY];
  bool holds_mlx_message;
} last_error_record;

static _Thread_local last_error_record last_error = {MLX_DUALNORM_OK, "", "", false};

void mlx_dualnorm_clear_last_error(void) {
  last_error.status = MLX_DUALNORM_OK;
  last_error.operation = "";
  last_error.description[0] = '\0';
  last_error.holds_mlx_message = false;
}

/* The installed mlx-c error handler: keeps the FIRST message since the
 * record was cleared, the root cause of a failure that propagates. */
static void record_mlx_error(const char* message, void* data) {
  (void)data;
  if (last_error.holds_mlx_message) {
    return;
  }
  last_error.status = MLX_DUALNORM_MLX_FAILURE;
  last_error.operation = MLX_C_CALL_OPERATION;
  snprintf(last_error.description, ERROR_DESCRIPTION_CAPACITY, "%s", message);
  last_error.holds_mlx_message = true;
}

void mlx_dualnorm_install_error_handler(void) {
  mlx_set_error_handler(record_mlx_error, NULL, NULL);
}

/* Names the failed operation; the description is MLX's own message. */
static int fail_in_mlx(const char* operation) {
  last_error.status = MLX_DUALNORM_MLX_FAILURE;
  last_error.operation = operation;
  if (!last_error.holds_mlx_message) {
    snprintf(last_error.description, ERROR_DESCRIPTION_CAPACITY,
             "MLX failed without a message");
  }
  return MLX_DUALNORM_MLX_FAILURE;
}

static int fail_with(mlx_dualnorm_status status, const char* operation,
                     const char* format, ...) __attribute__((format(printf, 3, 4)));

static int fail_with(mlx_dualnorm_status status, const char* operation,
                     const char* format, ...) {
  va_list arguments;
  last_error.status = status;
  last_error.operation = operation;
  va_start(arguments, format);
  vsnprintf(last_error.description, ERROR_DESCRIPTION_CAPACITY, format, arguments);
  va_end(arguments);
  return status;
}

mlx_dualnorm_status mlx_dualnorm_last_error_status(void) {
  return last_error.status;
}

const char* mlx_dualnorm_last_error_operation(void) {
  return last_error.operation;
}

const char* mlx_dualnorm_last_error_description(void) {
  return last_error.description;
}

/* ---- The process-wide epsilon slot --------------------------------------- */

/* Written only under trace_lock, by the apply about to (maybe) trace; read by
 * the builders during that trace. Atomic so a builder run outside any apply
 * (a caller composing its own closure) still reads a whole value. */
static _Atomic uint32_t baked_rms_norm_epsilon_bits = 0;
static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;

static void store_baked_rms_norm_epsilon(float rms_norm_epsilon) {
  uint32_t bits;
  memcpy(&bits, &rms_norm_epsilon, sizeof bits);
  atomic_store_explicit(&baked_rms_norm_epsilon_bits, bits, memory_order_relaxed);
}

static float baked_rms_norm_epsilon(void) {
  uint32_t bits = atomic_load_explicit(&baked_rms_norm_epsilon_bits, memory_order_relaxed);
  float rms_norm_epsilon;
  memcpy(&rms_norm_epsilon, &bits, sizeof rms_norm_epsilon);
  return rms_norm_epsilon;
}

/* ---- Graph builders ------------------------------------------------------ */

/* Weight layouts, indexing the compiled graphs: bit 0 = a query weight,
 * bit 1 = a key weight. */
enum {
  WEIGHTLESS_LAYOUT = 0,
  QUERY_WEIGHTED_LAYOUT = 1,
  KEY_WEIGHTED_LAYOUT = 2,
  WEIGHTED_LAYOUT = 3,
  WEIGHT_LAYOUT_COUNT = 4,
};

/* The stream that normalizes `input`: the default device's, except for an
 * empty input, which goes to the CPU: there is nothing to compute, and MLX
 * 0.32.4's CUDA RMSNorm divides by the width (SIGFPE for width 0). Empty
 * inputs never reach a compiled trace (runs_uncompiled), so this is decided
 * per call. */
static int select_stream(mlx_stream* stream, const mlx_array input,
                         const mlx_device default_device) {
  if (mlx_array_size(input) > 0) {
    return mlx_get_default_stream(stream, default_device);
  }
  mlx_device cpu_device = mlx_device_new_type(MLX_CPU, 0);
  int status = cpu_device.ctx == NULL || mlx_get_default_stream(stream, cpu_device) != 0;
  status |= mlx_device_free(cpu_device);
  return status;
}

/* Inputs: queries, keys, then the query weight and the key weight where the
 * layout has them. Output order is the caller's ABI: normalized queries
 * first, keys second, published once at the end (multi-output tracing reads
 * the result vector only after the builder returns). Every handle made here
 * is freed on every path; the input vector belongs to the closure. */
static int build_dual_head_norm_graph(mlx_vector_array* output_vector,
                                      const mlx_vector_array input_vector,
                                      bool has_query_weight, bool has_key_weight) {
  size_t expected_inputs = 2 + (size_t)has_query_weight + (size_t)has_key_weight;
  size_t received_inputs = mlx_vector_array_size(input_vector);
  if (output_vector == NULL || received_inputs != expected_inputs) {
    mlx_error("[dual head norm graph] expected %zu inputs and an output vector, "
              "received %zu inputs",
              expected_inputs, received_inputs);
    return 1;
  }
  mlx_array queries = mlx_array_new();
  mlx_array keys = mlx_array_new();
  mlx_array query_scale_weight = mlx_array_new(); /* stays empty: no weight */
  mlx_array key_scale_weight = mlx_array_new();
  mlx_array normalized_queries = mlx_array_new();
  mlx_array normalized_keys = mlx_array_new();
  mlx_device default_device = mlx_device_new();
  mlx_stream query_stream = mlx_stream_new();
  mlx_stream key_stream = mlx_stream_new();
  size_t next_input = 2;
  int status = 1;

  if (mlx_vector_array_get(&queries, input_vector, 0) != 0 ||
      mlx_vector_array_get(&keys, input_vector, 1) != 0) {
    goto cleanup;
  }
  if (has_query_weight &&
      mlx_vector_array_get(&query_scale_weight, input_vector, next_input++) != 0) {
    goto cleanup;
  }
  if (has_key_weight &&
      mlx_vector_array_get(&key_scale_weight, input_vector, next_input++) != 0) {
    goto cleanup;
  }
  /* The default device's stream, not a fixed GPU one: the same graph builds
   * on a CPU-only MLX, and a default-device change retraces onto it. */
  if (mlx_get_default_device(&default_device) != 0 ||
      select_stream(&query_stream, queries, default_device) != 0 ||
      select_stream(&key_stream, keys, default_device) != 0) {
    goto cleanup;
  }
  if (mlx_fast_rms_norm(&normalized_queries, queries, query_scale_weight,
                        baked_rms_norm_epsilon(), query_stream) != 0 ||
      mlx_fast_rms_norm(&normalized_keys, keys, key_scale_weight,
                        baked_rms_norm_epsilon(), key_stream) != 0) {
    goto cleanup;
  }
  {
    const mlx_array graph_outputs[2] = {normalized_queries, normalized_keys};
    status = mlx_vector_array_set_data(output_vector, graph_outputs, 2);
  }

cleanup:
  status |= mlx_array_free(queries);
  status |= mlx_array_free(keys);
  status |= mlx_array_free(query_scale_weight);
  status |= mlx_array_free(key_scale_weight);
  status |= mlx_array_free(normalized_queries);
  status |= mlx_array_free(normalized_keys);
  status |= mlx_stream_free(query_stream);
  status |= mlx_stream_free(key_stream);
  status |= mlx_device_free(default_device);
  return status;
}

static int build_weightless_graph(mlx_vector_array* output_vector,
                                  const mlx_vector_array input_vector) {
  return build_dual_head_norm_graph(output_vector, input_vector, false, false);
}

static int build_query_weighted_graph(mlx_vector_array* output_vector,
                                      const mlx_vector_array input_vector) {
  return build_dual_head_norm_graph(output_vector, input_vector, true, false);
}

static int build_key_weighted_graph(mlx_vector_array* output_vector,
                                    const mlx_vector_array input_vector) {
  return build_dual_head_norm_graph(output_vector, input_vector, false, true);
}

static int build_weighted_graph(mlx_vector_array* output_vector,
                                const mlx_vector_array input_vector) {
  return build_dual_head_norm_graph(output_vector, input_vector, true, true);
}

static int (*const graph_builders[WEIGHT_LAYOUT_COUNT])(mlx_vector_array*,
                                                         const mlx_vector_array) = {
    [WEIGHTLESS_LAYOUT] = build_weightless_graph,
    [QUERY_WEIGHTED_LAYOUT] = build_query_weighted_graph,
    [KEY_WEIGHTED_LAYOUT] = build_key_weighted_graph,
    [WEIGHTED_LAYOUT] = build_weighted_graph,
};

/* ---- Input checks a shapeless replay would skip --------------------------- */

static const char* dtype_name(mlx_dtype dtype) {
  static const char* const names[] = {
      [MLX_BOOL] = "bool",         [MLX_UINT8] = "uint8",     [MLX_UINT16] = "uint16",
      [MLX_UINT32] = "uint32",     [MLX_UINT64] = "uint64",   [MLX_INT8] = "int8",
      [MLX_INT16] = "int16",       [MLX_INT32] = "int32",     [MLX_INT64] = "int64",
      [MLX_FLOAT16] = "float16",   [MLX_FLOAT32] = "float32", [MLX_FLOAT64] = "float64",
      [MLX_BFLOAT16] = "bfloat16", [MLX_COMPLEX64] = "complex64",
  };
  return (unsigned)dtype <= MLX_COMPLEX64 ? names[dtype] : "unknown";
}

static bool is_real_floating(mlx_dtype dtype) {
  return dtype == MLX_FLOAT16 || dtype == MLX_FLOAT32 || dtype == MLX_FLOAT64 ||
         dtype == MLX_BFLOAT16;
}

/* MLX has no float64 on the GPU: its array constructor refuses any GPU op
 * with a float64 input or output (invalid_argument, a ValueError in Python),
 * so rms_norm on a GPU default device rejects a float64 input or weight
 * before anything runs, even an empty input. This apply rejects it the same
 * way, with the same kind of error; otherwise the failure would surface
 * later as an MLX error, or not at all for an empty input (which runs on
 * the CPU stream, see select_stream). Asks for the device only when a
 * float64 is present. */
static int check_float64_placement(const char* input_name, bool input_is_float64,
                                   const char* weight_name, bool weight_is_float64) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  if (!input_is_float64 && !weight_is_float64) {
    return MLX_DUALNORM_OK;
  }
  mlx_device default_device = mlx_device_new();
  mlx_device_type device_type = MLX_CPU;
  int lookup_status = mlx_get_default_device(&default_device) != 0 ||
                      mlx_device_get_type(&device_type, default_device) != 0;
  lookup_status |= mlx_device_free(default_device);
  if (lookup_status != 0) {
    return fail_in_mlx(operation);
  }
  if (device_type != MLX_GPU) {
    return MLX_DUALNORM_OK;
  }
  return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                   "%s %s dtype float64, which MLX does not support on the GPU "
                   "(the default device)",
                   input_is_float64 ? input_name : weight_name,
                   input_is_float64 ? "have" : "has");
}

/* rms_norm's preconditions for one side: at least one dimension; a weight,
 * if any, one-dimensional and as long as the last dimension; a result
 * dtype, MLX's promotion of the input and weight dtypes, that is a real
 * floating type (promotion yields one exactly when neither is complex and
 * at least one is real floating); and no float64 on the GPU. */
static int check_head_norm_input(const char* input_name, const mlx_array input,
                                 const char* weight_name, const mlx_array weight) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  if (input.ctx == NULL) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s is an empty array handle", input_name);
  }
  size_t input_rank = mlx_array_ndim(input);
  if (input_rank == 0) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s must have at least 1 dimension but have 0", input_name);
  }
  int width = mlx_array_shape(input)[input_rank - 1];
  mlx_dtype input_dtype = mlx_array_dtype(input);
  if (weight.ctx == NULL) {
    if (!is_real_floating(input_dtype)) {
      return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                       "%s have unsupported dtype %s; expected a floating dtype",
                       input_name, dtype_name(input_dtype));
    }
    return check_float64_placement(input_name, input_dtype == MLX_FLOAT64, weight_name, false);
  }
  size_t weight_rank = mlx_array_ndim(weight);
  if (weight_rank != 1) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s must have 1 dimension but has %zu", weight_name, weight_rank);
  }
  int weight_length = mlx_array_shape(weight)[0];
  if (weight_length != width) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s has %d elements but the last dimension of %s is %d",
                     weight_name, weight_length, input_name, width);
  }
  mlx_dtype weight_dtype = mlx_array_dtype(weight);
  bool any_complex = input_dtype == MLX_COMPLEX64 || weight_dtype == MLX_COMPLEX64;
  if (any_complex || !(is_real_floating(input_dtype) || is_real_floating(weight_dtype))) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s of dtype %s with a %s of dtype %s do not normalize to a "
                     "floating dtype",
                     input_name, dtype_name(input_dtype), weight_name,
                     dtype_name(weight_dtype));
  }
  return check_float64_placement(input_name, input_dtype == MLX_FLOAT64, weight_name,
                                 weight_dtype == MLX_FLOAT64);
}

/* The width of a checked input (rank >= 1). */
static int last_dimension(const mlx_array input) {
  return mlx_array_shape(input)[mlx_array_ndim(input) - 1];
}

/* ---- The compiled dual head norm ----------------------------------------- */

/* Compile ids: a tag above every user-space address (MLX's own ids are
 * addresses), then a process-wide serial and the layout. */
static const uint64_t COMPILE_ID_TAG = UINT64_C(0xD0A1) << 48;
static _Atomic uint64_t next_compile_serial = 1;

struct mlx_dualnorm_compiled_dual_head_norm_ {
  /* Owned closures, one per weight layout: the plain builders (run in
   * composed mode and for widths <= 1) and their compiled forms (empty in
   * composed mode). All empty once closed. Read and released only under
   * trace_lock. */
  mlx_closure plain_graphs[WEIGHT_LAYOUT_COUNT];
  mlx_closure compiled_graphs[WEIGHT_LAYOUT_COUNT];
  uintptr_t compile_ids[WEIGHT_LAYOUT_COUNT];
  float rms_norm_epsilon;
  mlx_dualnorm_mode mode;
  /* Written under trace_lock; atomic so the fused path may read it without. */
  atomic_bool closed;
};

/* Frees the compiled graphs; the caller holds trace_lock or is the only
 * user. */
static int release_compiled_graphs(mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  int status = 0;
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    if (dual_head_norm->compiled_graphs[layout].ctx != NULL) {
      status |= mlx_detail_compile_erase(dual_head_norm->compile_ids[layout]);
    }
    status |= mlx_closure_free(dual_head_norm->compiled_graphs[layout]);
    status |= mlx_closure_free(dual_head_norm->plain_graphs[layout]);
    dual_head_norm->compiled_graphs[layout] = mlx_closure_new();
    dual_head_norm->plain_graphs[layout] = mlx_closure_new();
  }
  dual_head_norm->closed = true;
  return status;
}

/* Resolves AUTO, and checks FUSED can run here (compiling its kernel). */
static int resolve_mode(mlx_dualnorm_mode requested, mlx_dualnorm_mode* resolved) {
  const char* operation = COMPILE_DUAL_HEAD_NORM_OPERATION;
  switch (requested) {
    case MLX_DUALNORM_MODE_COMPOSED:
    case MLX_DUALNORM_MODE_COMPILED:
      *resolved = requested;
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_AUTO:
      /* A kernel that fails to compile leaves AUTO on the compiled graph;
       * the record it left is cleared by the next call. */
      *resolved = mlx_dualnorm_fused_backend_available() && mlx_dualnorm_fused_prepare() == 0
                      ? MLX_DUALNORM_MODE_FUSED
                      : MLX_DUALNORM_MODE_COMPILED;
      mlx_dualnorm_clear_last_error();
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_FUSED:
      if (!mlx_dualnorm_fused_backend_available()) {
        return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                         "mode 'fused' needs MLX's CUDA backend, and this MLX has no "
                         "CUDA GPU; use mode 'auto' or 'compiled'");
      }
      if (mlx_dualnorm_fused_prepare() != 0) {
        return fail_in_mlx(operation);
      }
      *resolved = MLX_DUALNORM_MODE_FUSED;
      return MLX_DUALNORM_OK;
  }
  return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation, "unknown mode %d",
                   (int)requested);
}

int mlx_dualnorm_compiled_dual_head_norm_new(mlx_dualnorm_compiled_dual_head_norm** res,
                                             float rms_norm_epsilon, mlx_dualnorm_mode mode) {
  const char* operation = COMPILE_DUAL_HEAD_NORM_OPERATION;
  mlx_dualnorm_clear_last_error();
  if (res == NULL) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation, "the result pointer is NULL");
  }
  if (!isfinite(rms_norm_epsilon) || rms_norm_epsilon < 0.0f) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "the RMS epsilon must be finite and >= 0, got %g",
                     (double)rms_norm_epsilon);
  }
  mlx_dualnorm_mode resolved_mode = MLX_DUALNORM_MODE_COMPILED;
  int status = resolve_mode(mode, &resolved_mode);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  mlx_dualnorm_compiled_dual_head_norm* dual_head_norm = calloc(1, sizeof *dual_head_norm);
  if (dual_head_norm == NULL) {
    return fail_with(MLX_DUALNORM_MLX_FAILURE, operation, "out of host memory");
  }
  dual_head_norm->rms_norm_epsilon = rms_norm_epsilon;
  dual_head_norm->mode = resolved_mode;
  bool compile_graphs = resolved_mode != MLX_DUALNORM_MODE_COMPOSED;
  uint32_t epsilon_bits;
  memcpy(&epsilon_bits, &rms_norm_epsilon, sizeof epsilon_bits);
  const uint64_t compile_constants[1] = {epsilon_bits};
  uint64_t serial = atomic_fetch_add(&next_compile_serial, 1);
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    dual_head_norm->plain_graphs[layout] = mlx_closure_new_func(graph_builders[layout]);
    dual_head_norm->compiled_graphs[layout] = mlx_closure_new();
    dual_head_norm->compile_ids[layout] =
        (uintptr_t)(COMPILE_ID_TAG | (serial << 2) | (uint64_t)layout);
    int compile_status = dual_head_norm->plain_graphs[layout].ctx == NULL;
    if (compile_status == 0 && compile_graphs) {
      compile_status = mlx_detail_compile(
          &dual_head_norm->compiled_graphs[layout], dual_head_norm->plain_graphs[layout],
          dual_head_norm->compile_ids[layout], true, compile_constants, 1);
    }
    if (compile_status != 0) {
      release_compiled_graphs(dual_head_norm);
      free(dual_head_norm);
      return fail_in_mlx(operation);
    }
  }
  *res = dual_head_norm;
  return MLX_DUALNORM_OK;
}

mlx_dualnorm_mode mlx_dualnorm_compiled_dual_head_norm_mode(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  return dual_head_norm == NULL ? MLX_DUALNORM_MODE_AUTO : dual_head_norm->mode;
}

float mlx_dualnorm_compiled_dual_head_norm_epsilon(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  return dual_head_norm == NULL ? NAN : dual_head_norm->rms_norm_epsilon;
}

enum { COMPILED_GRAPH_MAX_ROWS = 48 };

/* Whether this call runs the plain builder rather than the compiled graph
 * (see the file comment): composed mode, widths 0 and 1, empty inputs, and
 * large calls. */
static bool runs_uncompiled(const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                            const mlx_array queries, const mlx_array keys) {
  int query_width = last_dimension(queries);
  int key_width = last_dimension(keys);
  size_t query_size = mlx_array_size(queries);
  size_t key_size = mlx_array_size(keys);
  if (dual_head_norm->mode == MLX_DUALNORM_MODE_COMPOSED || query_width <= 1 || key_width <= 1 ||
      query_size == 0 || key_size == 0) {
    return true;
  }
  size_t rows = query_size / (size_t)query_width + key_size / (size_t)key_width;
  return rows > COMPILED_GRAPH_MAX_ROWS;
}

int mlx_dualnorm_apply_compiled_dual_head_norm(
    mlx_vector_array* res, mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
    const mlx_array queries, const mlx_array keys, const mlx_array query_scale_weight,
    const mlx_array key_scale_weight) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  mlx_dualnorm_clear_last_error();
  if (res == NULL || dual_head_norm == NULL) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "the result vector or the dual head norm is NULL");
  }
  int status = check_head_norm_input("queries", queries, "query scale weight",
                                     query_scale_weight);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  status = check_head_norm_input("keys", keys, "key scale weight", key_scale_weight);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }

  if (dual_head_norm->mode == MLX_DUALNORM_MODE_FUSED &&
      mlx_dualnorm_fused_supports(queries, keys, query_scale_weight, key_scale_weight)) {
    /* No graph, so no trace and no lock: the epsilon is a kernel argument,
     * and closing frees no state this launch uses. */
    if (dual_head_norm->closed) {
      return fail_with(MLX_DUALNORM_CLOSED, operation, "the dual head norm is closed");
    }
    if (mlx_dualnorm_fused_apply(res, queries, keys, query_scale_weight, key_scale_weight,
                                 dual_head_norm->rms_norm_epsilon) != 0) {
      return fail_in_mlx(operation);
    }
    return MLX_DUALNORM_OK;
  }

  int layout = (query_scale_weight.ctx != NULL ? QUERY_WEIGHTED_LAYOUT : 0) |
               (key_scale_weight.ctx != NULL ? KEY_WEIGHTED_LAYOUT : 0);
  mlx_array graph_inputs[4] = {queries, keys};
  size_t input_count = 2;
  if (query_scale_weight.ctx != NULL) {
    graph_inputs[input_count++] = query_scale_weight;
  }
  if (key_scale_weight.ctx != NULL) {
    graph_inputs[input_count++] = key_scale_weight;
  }
  /* The vector takes its own references; the caller's handles stay
   * borrowed. Freed below on every path. */
  mlx_vector_array input_vector = mlx_vector_array_new_data(graph_inputs, input_count);
  if (input_vector.ctx == NULL) {
    return fail_in_mlx(operation);
  }

  bool run_uncompiled = runs_uncompiled(dual_head_norm, queries, keys);
  pthread_mutex_lock(&trace_lock);
  int apply_status = 0;
  bool closed = dual_head_norm->closed;
  if (!closed) {
    store_baked_rms_norm_epsilon(dual_head_norm->rms_norm_epsilon);
    apply_status = mlx_closure_apply(
        res,
        run_uncompiled ? dual_head_norm->plain_graphs[layout]
                       : dual_head_norm->compiled_graphs[layout],
        input_vector);
  }
  pthread_mutex_unlock(&trace_lock);

  int free_status = mlx_vector_array_free(input_vector);
  if (closed) {
    return fail_with(MLX_DUALNORM_CLOSED, operation, "the dual head norm is closed");
  }
  if (apply_status != 0 || free_status != 0) {
    return fail_in_mlx(operation);
  }
  return MLX_DUALNORM_OK;
}

int mlx_dualnorm_compiled_dual_head_norm_close(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  mlx_dualnorm_clear_last_error();
  if (dual_head_norm == NULL) {
    return fail_with(MLX_DUALNORM_INVALID_ARGUMENT, CLOSE_DUAL_HEAD_NORM_OPERATION,
                     "the dual head norm is NULL");
  }
  pthread_mutex_lock(&trace_lock);
  int status = dual_head_norm->closed ? 0 : release_compiled_graphs(dual_head_norm);
  pthread_mutex_unlock(&trace_lock);
  return status == 0 ? MLX_DUALNORM_OK : fail_in_mlx(CLOSE_DUAL_HEAD_NORM_OPERATION);
}

void mlx_dualnorm_compiled_dual_head_norm_free(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  if (dual_head_norm == NULL) {
    return;
  }
  mlx_dualnorm_compiled_dual_head_norm_close(dual_head_norm);
  free(dual_head_norm);
}
