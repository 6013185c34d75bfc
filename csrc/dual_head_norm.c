/* Epsilon-specialized compiled composite fusing the q/k head
 * normalizations.
 *
 * The query/key head RMS normalizations of a layer's prework ran as two
 * graph builds; one dual-output replay of a shapeless compiled graph
 * produces both. Every primitive and its order match the composed path:
 * the builder calls mlx_fast_rms_norm on each input exactly as two separate
 * calls would, so MLX emits the same kernels over the same inputs.
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
 * (the registered fused backend) takes the epsilon as a kernel argument, so
 * neither the slot nor the lock is involved.
 *
 * Each object compiles under ids of its own, never reused, with its
 * epsilon's bits as a compile constant: MLX's compile cache is per thread
 * and mlx_detail_compile_erase clears only the calling thread's, so a
 * reused id (MLX's default, the closure's address) could let a new object
 * replay an old object's trace, with the old epsilon, on another thread.
 * Closing erases the closing thread's entries at once and hands every other
 * thread's to that thread's next apply (or its exit, which drops its cache):
 * a graph traced on a worker and closed elsewhere leaves nothing behind.
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
 * read out of bounds without a word. The apply checks, on every call and in
 * one place (inspect_head_norm_input), the preconditions rms_norm checks at
 * trace time, and reports them as invalid arguments. The facts it reads
 * there also choose the route (fused, compiled, uncompiled): nothing about
 * an input is read twice.
 */
#include "dual_head_norm.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
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
static const char BUILD_DUAL_HEAD_NORM_GRAPH_OPERATION[] = "build the dual head norm graph";

/* ---- Errors: the caller's record, filled before a failing return -------- */

/* The first MLX message this thread received since its current call into
 * this API began: the root cause, when a failure inside a graph builder
 * propagates out through the closure and the compiled graph (each layer
 * reports again). Thread-local because MLX reports through one process-wide
 * handler; it never leaves this file: entry points copy it into the
 * caller's mlx_dualnorm_error before they return. */
typedef struct first_mlx_message {
  bool held;
  char text[sizeof(((mlx_dualnorm_error*)0)->description)];
} first_mlx_message;

static _Thread_local first_mlx_message mlx_message = {false, ""};

static void begin_call(void) {
  mlx_message.held = false;
  mlx_message.text[0] = '\0';
}

/* Upstream mlx-c appends " at FILE:LINE" (its own source) to every message;
 * that names no user input, so it is dropped. */
static void drop_source_location(char* message) {
  char* location = strrchr(message, ' ');
  if (location == NULL || location - message < 3 || strncmp(location - 3, " at", 3) != 0) {
    return;
  }
  const char* line_number = strrchr(location, ':');
  if (line_number == NULL || line_number[1] == '\0' ||
      strspn(line_number + 1, "0123456789") != strlen(line_number + 1)) {
    return;
  }
  location[-3] = '\0';
}

static void keep_first_mlx_message(const char* message, void* data) {
  (void)data;
  if (mlx_message.held) {
    return;
  }
  snprintf(mlx_message.text, sizeof mlx_message.text, "%s", message);
  drop_source_location(mlx_message.text);
  mlx_message.held = true;
}

void mlx_dualnorm_install_error_handler(void) {
  mlx_set_error_handler(keep_first_mlx_message, NULL, NULL);
}

static int fail_with(mlx_dualnorm_error* error, mlx_dualnorm_status status,
                     const char* operation, const char* format, ...)
    __attribute__((format(printf, 4, 5)));

static int fail_with(mlx_dualnorm_error* error, mlx_dualnorm_status status,
                     const char* operation, const char* format, ...) {
  if (error != NULL) {
    va_list arguments;
    error->status = status;
    error->operation = operation;
    va_start(arguments, format);
    vsnprintf(error->description, sizeof error->description, format, arguments);
    va_end(arguments);
  }
  return status;
}

/* Names the failed operation; the description is MLX's own message. */
static int fail_in_mlx(mlx_dualnorm_error* error, const char* operation) {
  return fail_with(error, MLX_DUALNORM_MLX_FAILURE, operation, "%s",
                   mlx_message.held ? mlx_message.text : "MLX failed without a message");
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

/* ---- The fused backend --------------------------------------------------- */

static const mlx_dualnorm_fused_backend* _Atomic registered_fused_backend = NULL;

void mlx_dualnorm_set_fused_backend(const mlx_dualnorm_fused_backend* backend) {
  atomic_store(&registered_fused_backend, backend);
}

bool mlx_dualnorm_fused_mode_available(void) {
  const mlx_dualnorm_fused_backend* backend = atomic_load(&registered_fused_backend);
  return backend != NULL && backend->available();
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
 * inputs never reach a compiled trace (they take the plain builder), so
 * this is decided per call. */
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

/* One side of the graph: an input and its weight (empty: none), both
 * borrowed from the closure's input vector by handles this builder owns. */
typedef struct graph_side {
  mlx_array input;
  mlx_array scale_weight;
} graph_side;

/* rms_norm of one side on the stream select_stream picks. */
static int normalize_side(mlx_array* normalized, const graph_side side,
                          const mlx_device default_device) {
  mlx_stream stream = mlx_stream_new();
  int status = select_stream(&stream, side.input, default_device) != 0 ||
               mlx_fast_rms_norm(normalized, side.input, side.scale_weight,
                                 baked_rms_norm_epsilon(), stream) != 0;
  status |= mlx_stream_free(stream);
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
    mlx_error("[%s] expected %zu inputs and an output vector, received %zu inputs",
              BUILD_DUAL_HEAD_NORM_GRAPH_OPERATION, expected_inputs, received_inputs);
    return 1;
  }
  graph_side queries = {mlx_array_new(), mlx_array_new()};
  graph_side keys = {mlx_array_new(), mlx_array_new()};
  mlx_array normalized[2] = {mlx_array_new(), mlx_array_new()};
  mlx_device default_device = mlx_device_new();
  size_t next_input = 2;
  int status = mlx_vector_array_get(&queries.input, input_vector, 0) != 0 ||
               mlx_vector_array_get(&keys.input, input_vector, 1) != 0 ||
               (has_query_weight &&
                mlx_vector_array_get(&queries.scale_weight, input_vector, next_input++) != 0) ||
               (has_key_weight &&
                mlx_vector_array_get(&keys.scale_weight, input_vector, next_input++) != 0) ||
               /* The default device's stream, not a fixed GPU one: the same
                * graph builds on a CPU-only MLX, and a default-device change
                * retraces onto it. */
               mlx_get_default_device(&default_device) != 0 ||
               normalize_side(&normalized[0], queries, default_device) != 0 ||
               normalize_side(&normalized[1], keys, default_device) != 0 ||
               mlx_vector_array_set_data(output_vector, normalized, 2) != 0;
  status |= mlx_array_free(queries.input);
  status |= mlx_array_free(queries.scale_weight);
  status |= mlx_array_free(keys.input);
  status |= mlx_array_free(keys.scale_weight);
  status |= mlx_array_free(normalized[0]);
  status |= mlx_array_free(normalized[1]);
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

/* ---- Inputs: checked once, in one place ----------------------------------- */

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

/* Reads the facts of one side and checks rms_norm's preconditions: at least
 * one dimension; a weight, if any, one-dimensional and as long as the last
 * dimension; and a result dtype, MLX's promotion of the input and weight
 * dtypes, that is a real floating type (promotion yields one exactly when
 * neither is complex and at least one is real floating). */
static int inspect_head_norm_input(head_norm_input* side, const char* input_name,
                                   const mlx_array input, const char* weight_name,
                                   const mlx_array weight, mlx_dualnorm_error* error) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  if (input.ctx == NULL) {
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s is an empty array handle", input_name);
  }
  side->array = input;
  side->weight = weight;
  side->rank = mlx_array_ndim(input);
  if (side->rank == 0) {
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s must have at least 1 dimension but have 0", input_name);
  }
  side->width = mlx_array_shape(input)[side->rank - 1];
  side->size = mlx_array_size(input);
  side->rows = side->width > 0 ? side->size / (size_t)side->width : 0;
  side->dtype = mlx_array_dtype(input);
  side->weight_dtype = side->dtype;
  if (weight.ctx != NULL) {
    size_t weight_rank = mlx_array_ndim(weight);
    if (weight_rank != 1) {
      return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                       "%s must have 1 dimension but has %zu", weight_name, weight_rank);
    }
    int weight_length = mlx_array_shape(weight)[0];
    if (weight_length != side->width) {
      return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                       "%s has %d elements but the last dimension of %s is %d",
                       weight_name, weight_length, input_name, side->width);
    }
    side->weight_dtype = mlx_array_dtype(weight);
  }
  bool any_complex = side->dtype == MLX_COMPLEX64 || side->weight_dtype == MLX_COMPLEX64;
  if (any_complex || !(is_real_floating(side->dtype) || is_real_floating(side->weight_dtype))) {
    if (weight.ctx == NULL) {
      return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                       "%s have unsupported dtype %s; expected a floating dtype",
                       input_name, dtype_name(side->dtype));
    }
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "%s of dtype %s with a %s of dtype %s do not normalize to a "
                     "floating dtype",
                     input_name, dtype_name(side->dtype), weight_name,
                     dtype_name(side->weight_dtype));
  }
  return MLX_DUALNORM_OK;
}

/* Whether the default device is the GPU, asked of MLX at most once a call
 * and only by the checks that depend on it. */
static int default_device_is_gpu(dual_head_norm_call* call, bool* is_gpu,
                                 mlx_dualnorm_error* error) {
  if (!call->default_device_known) {
    mlx_device default_device = mlx_device_new();
    mlx_device_type device_type = MLX_CPU;
    int status = mlx_get_default_device(&default_device) != 0 ||
                 mlx_device_get_type(&device_type, default_device) != 0;
    status |= mlx_device_free(default_device);
    if (status != 0) {
      return fail_in_mlx(error, APPLY_DUAL_HEAD_NORM_OPERATION);
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
 * all for an empty input (which runs on the CPU stream, see select_stream). */
static int check_float64_placement(dual_head_norm_call* call, mlx_dualnorm_error* error) {
  const head_norm_input* sides[2] = {&call->queries, &call->keys};
  static const char* const input_names[2] = {"queries", "keys"};
  static const char* const weight_names[2] = {"query scale weight", "key scale weight"};
  for (int index = 0; index < 2; ++index) {
    bool input_is_float64 = sides[index]->dtype == MLX_FLOAT64;
    if (!input_is_float64 && sides[index]->weight_dtype != MLX_FLOAT64) {
      continue;
    }
    bool is_gpu = false;
    int status = default_device_is_gpu(call, &is_gpu, error);
    if (status != MLX_DUALNORM_OK || !is_gpu) {
      return status;
    }
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, APPLY_DUAL_HEAD_NORM_OPERATION,
                     "%s %s dtype float64, which MLX does not support on the GPU "
                     "(the default device)",
                     input_is_float64 ? input_names[index] : weight_names[index],
                     input_is_float64 ? "have" : "has");
  }
  return MLX_DUALNORM_OK;
}

/* ---- Compile-cache entries of other threads ------------------------------ */

/* MLX keeps one compile cache per thread, and mlx_detail_compile_erase
 * clears the calling thread's alone (upstream mlx-c's contract). A thread
 * that traced a graph and was then left alone would keep that trace until it
 * exits. So every thread that applies registers here, and closing an object
 * queues its compile ids on every other registered thread; each thread
 * erases its queue at the start of its next apply. A thread's exit drops its
 * MLX cache and, through the key destructor, its queue. Ids are never
 * reused, so a late erase can only hit the closed object's own traces. */
typedef struct applying_thread {
  struct applying_thread* next;
  uintptr_t* queued_ids; /* owned; erased and emptied by the thread itself */
  size_t queued_count;
  size_t queued_capacity;
  atomic_bool has_queued_ids; /* read without the lock on every apply */
} applying_thread;

static pthread_mutex_t applying_threads_lock = PTHREAD_MUTEX_INITIALIZER;
static applying_thread* applying_threads = NULL;
static _Thread_local applying_thread* this_applying_thread = NULL;
static pthread_key_t applying_thread_key;
static pthread_once_t applying_thread_key_once = PTHREAD_ONCE_INIT;

/* Runs at a registered thread's exit: unlinks and frees its record. */
static void forget_applying_thread(void* record) {
  applying_thread* exiting = record;
  pthread_mutex_lock(&applying_threads_lock);
  for (applying_thread** link = &applying_threads; *link != NULL; link = &(*link)->next) {
    if (*link == exiting) {
      *link = exiting->next;
      break;
    }
  }
  pthread_mutex_unlock(&applying_threads_lock);
  free(exiting->queued_ids);
  free(exiting);
}

static void create_applying_thread_key(void) {
  pthread_key_create(&applying_thread_key, forget_applying_thread);
}

/* Registers the calling thread once; false when out of host memory. */
static bool register_applying_thread(void) {
  if (this_applying_thread != NULL) {
    return true;
  }
  pthread_once(&applying_thread_key_once, create_applying_thread_key);
  applying_thread* record = calloc(1, sizeof *record);
  if (record == NULL || pthread_setspecific(applying_thread_key, record) != 0) {
    free(record);
    return false;
  }
  pthread_mutex_lock(&applying_threads_lock);
  record->next = applying_threads;
  applying_threads = record;
  pthread_mutex_unlock(&applying_threads_lock);
  this_applying_thread = record;
  return true;
}

/* Erases the compile-cache entries other threads' closes queued here. */
static int erase_queued_compile_ids(void) {
  applying_thread* record = this_applying_thread;
  if (record == NULL || !atomic_load_explicit(&record->has_queued_ids, memory_order_acquire)) {
    return 0;
  }
  pthread_mutex_lock(&applying_threads_lock);
  uintptr_t* queued_ids = record->queued_ids;
  size_t queued_count = record->queued_count;
  record->queued_ids = NULL;
  record->queued_count = record->queued_capacity = 0;
  atomic_store_explicit(&record->has_queued_ids, false, memory_order_relaxed);
  pthread_mutex_unlock(&applying_threads_lock);
  int status = 0;
  for (size_t index = 0; index < queued_count; ++index) {
    status |= mlx_detail_compile_erase(queued_ids[index]);
  }
  free(queued_ids);
  return status;
}

/* Appends `count` ids to a thread's queue; the caller holds the lock. */
static bool queue_compile_ids(applying_thread* record, const uintptr_t* ids, size_t count) {
  if (record->queued_count + count > record->queued_capacity) {
    size_t capacity = 2 * (record->queued_count + count);
    uintptr_t* grown = realloc(record->queued_ids, capacity * sizeof *grown);
    if (grown == NULL) {
      return false;
    }
    record->queued_ids = grown;
    record->queued_capacity = capacity;
  }
  memcpy(record->queued_ids + record->queued_count, ids, count * sizeof *ids);
  record->queued_count += count;
  atomic_store_explicit(&record->has_queued_ids, true, memory_order_release);
  return true;
}

/* Erases `ids` from the calling thread's cache now and queues them on every
 * other applying thread. Non-zero when an erase failed or host memory ran
 * out (that thread then keeps the traces until it exits). */
static int erase_compile_ids_everywhere(const uintptr_t* ids, size_t count) {
  int status = 0;
  for (size_t index = 0; index < count; ++index) {
    status |= mlx_detail_compile_erase(ids[index]);
  }
  pthread_mutex_lock(&applying_threads_lock);
  for (applying_thread* record = applying_threads; record != NULL; record = record->next) {
    if (record != this_applying_thread && !queue_compile_ids(record, ids, count)) {
      status = 1;
    }
  }
  pthread_mutex_unlock(&applying_threads_lock);
  return status;
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
  /* In FUSED mode, the backend resolved at construction (never NULL). */
  const mlx_dualnorm_fused_backend* fused_backend;
  /* Written under trace_lock; atomic so the fused path may read it without. */
  atomic_bool closed;
};

/* Frees the compiled graphs and erases their traces from every thread's
 * cache; the caller holds trace_lock or is the only user. */
static int release_compiled_graphs(mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  int status = 0;
  if (dual_head_norm->mode != MLX_DUALNORM_MODE_COMPOSED) {
    status |= erase_compile_ids_everywhere(dual_head_norm->compile_ids, WEIGHT_LAYOUT_COUNT);
  }
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    status |= mlx_closure_free(dual_head_norm->compiled_graphs[layout]);
    status |= mlx_closure_free(dual_head_norm->plain_graphs[layout]);
    dual_head_norm->compiled_graphs[layout] = mlx_closure_new();
    dual_head_norm->plain_graphs[layout] = mlx_closure_new();
  }
  dual_head_norm->closed = true;
  return status;
}

/* Resolves AUTO, and checks FUSED can run here (compiling its kernel). */
static int resolve_mode(mlx_dualnorm_mode requested, mlx_dualnorm_mode* resolved,
                        const mlx_dualnorm_fused_backend** fused_backend,
                        mlx_dualnorm_error* error) {
  const char* operation = COMPILE_DUAL_HEAD_NORM_OPERATION;
  const mlx_dualnorm_fused_backend* backend = atomic_load(&registered_fused_backend);
  bool fused_available = backend != NULL && backend->available();
  *fused_backend = NULL;
  switch (requested) {
    case MLX_DUALNORM_MODE_COMPOSED:
    case MLX_DUALNORM_MODE_COMPILED:
      *resolved = requested;
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_AUTO:
      /* A kernel that fails to compile leaves AUTO on the compiled graph. */
      if (fused_available && backend->prepare() == 0) {
        *resolved = MLX_DUALNORM_MODE_FUSED;
        *fused_backend = backend;
      } else {
        *resolved = MLX_DUALNORM_MODE_COMPILED;
      }
      begin_call(); /* forget a failed preparation's message */
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_FUSED:
      if (!fused_available) {
        return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                         "mode 'fused' needs a build with the fused mode and MLX's CUDA "
                         "backend with a GPU; use mode 'auto' or 'compiled'");
      }
      if (backend->prepare() != 0) {
        return fail_in_mlx(error, operation);
      }
      *resolved = MLX_DUALNORM_MODE_FUSED;
      *fused_backend = backend;
      return MLX_DUALNORM_OK;
  }
  return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation, "unknown mode %d",
                   (int)requested);
}

/* Builds the plain and (unless composed) compiled closure of every layout. */
static int compile_graphs(mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  float rms_norm_epsilon = dual_head_norm->rms_norm_epsilon;
  uint32_t epsilon_bits;
  memcpy(&epsilon_bits, &rms_norm_epsilon, sizeof epsilon_bits);
  const uint64_t compile_constants[1] = {epsilon_bits};
  uint64_t serial = atomic_fetch_add(&next_compile_serial, 1);
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    dual_head_norm->compiled_graphs[layout] = mlx_closure_new();
    dual_head_norm->compile_ids[layout] =
        (uintptr_t)(COMPILE_ID_TAG | (serial << 2) | (uint64_t)layout);
    dual_head_norm->plain_graphs[layout] = mlx_closure_new_func(graph_builders[layout]);
  }
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    if (dual_head_norm->plain_graphs[layout].ctx == NULL) {
      return 1;
    }
    if (dual_head_norm->mode != MLX_DUALNORM_MODE_COMPOSED &&
        mlx_detail_compile(&dual_head_norm->compiled_graphs[layout],
                           dual_head_norm->plain_graphs[layout],
                           dual_head_norm->compile_ids[layout], true, compile_constants,
                           1) != 0) {
      return 1;
    }
  }
  return 0;
}

int mlx_dualnorm_compiled_dual_head_norm_new(mlx_dualnorm_compiled_dual_head_norm** res,
                                             double rms_norm_epsilon, mlx_dualnorm_mode mode,
                                             mlx_dualnorm_error* error) {
  const char* operation = COMPILE_DUAL_HEAD_NORM_OPERATION;
  begin_call();
  if (res == NULL) {
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "the result pointer is NULL");
  }
  /* Checked as given, before rounding to float32: -1e-50 is negative even
   * though it rounds to -0.0, and 1e39 is out of range though finite. */
  if (!isfinite(rms_norm_epsilon) || rms_norm_epsilon < 0.0 || rms_norm_epsilon > FLT_MAX) {
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "eps must be finite, >= 0 and within float32's range, got %g",
                     rms_norm_epsilon);
  }
  mlx_dualnorm_mode resolved_mode = MLX_DUALNORM_MODE_COMPILED;
  const mlx_dualnorm_fused_backend* fused_backend = NULL;
  int status = resolve_mode(mode, &resolved_mode, &fused_backend, error);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  mlx_dualnorm_compiled_dual_head_norm* dual_head_norm = calloc(1, sizeof *dual_head_norm);
  if (dual_head_norm == NULL) {
    return fail_with(error, MLX_DUALNORM_MLX_FAILURE, operation, "out of host memory");
  }
  dual_head_norm->rms_norm_epsilon = (float)rms_norm_epsilon;
  dual_head_norm->mode = resolved_mode;
  dual_head_norm->fused_backend = fused_backend;
  if (compile_graphs(dual_head_norm) != 0) {
    status = fail_in_mlx(error, operation);
    release_compiled_graphs(dual_head_norm);
    free(dual_head_norm);
    return status;
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

/* ---- Applying: one route per call ---------------------------------------- */

enum { COMPILED_GRAPH_MAX_ROWS = 48 };

typedef enum dual_head_norm_route {
  FUSED_KERNEL_ROUTE,
  COMPILED_GRAPH_ROUTE,
  /* The plain builder: the composed graph (see the file comment for when). */
  PLAIN_GRAPH_ROUTE,
} dual_head_norm_route;

static bool is_fused_dtype(mlx_dtype dtype) {
  return dtype == MLX_FLOAT32 || dtype == MLX_FLOAT16 || dtype == MLX_BFLOAT16;
}

/* Whether the fused kernel computes exactly what rms_norm would: one
 * float dtype for every input, rows on both sides, ranks the kernel
 * indexes, rows that fit its 32-bit row index, the CUDA GPU by default. */
static int fused_kernel_takes(const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                              dual_head_norm_call* call, bool* takes,
                              mlx_dualnorm_error* error) {
  const head_norm_input* queries = &call->queries;
  const head_norm_input* keys = &call->keys;
  int max_rank = dual_head_norm->fused_backend->max_rank;
  mlx_dtype dtype = queries->dtype;
  *takes = is_fused_dtype(dtype) && queries->weight_dtype == dtype && keys->dtype == dtype &&
           keys->weight_dtype == dtype && queries->size > 0 && keys->size > 0 &&
           queries->rank <= (size_t)max_rank && keys->rank <= (size_t)max_rank &&
           queries->rows + keys->rows <= (size_t)INT_MAX;
  return *takes ? default_device_is_gpu(call, takes, error) : MLX_DUALNORM_OK;
}

static int choose_route(const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                        dual_head_norm_call* call, dual_head_norm_route* route,
                        mlx_dualnorm_error* error) {
  if (dual_head_norm->mode == MLX_DUALNORM_MODE_FUSED) {
    bool takes = false;
    int status = fused_kernel_takes(dual_head_norm, call, &takes, error);
    if (status != MLX_DUALNORM_OK || takes) {
      *route = FUSED_KERNEL_ROUTE;
      return status;
    }
  }
  const head_norm_input* queries = &call->queries;
  const head_norm_input* keys = &call->keys;
  bool plain = dual_head_norm->mode == MLX_DUALNORM_MODE_COMPOSED || queries->width <= 1 ||
               keys->width <= 1 || queries->size == 0 || keys->size == 0 ||
               queries->rows + keys->rows > COMPILED_GRAPH_MAX_ROWS;
  *route = plain ? PLAIN_GRAPH_ROUTE : COMPILED_GRAPH_ROUTE;
  return MLX_DUALNORM_OK;
}

/* No graph, so no trace and no lock: the epsilon is a kernel argument, and
 * closing frees no state this launch uses. */
static int apply_fused_kernel(mlx_vector_array* res,
                              const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                              const dual_head_norm_call* call, mlx_dualnorm_error* error) {
  if (dual_head_norm->closed) {
    return fail_with(error, MLX_DUALNORM_CLOSED, APPLY_DUAL_HEAD_NORM_OPERATION,
                     "the dual head norm is closed");
  }
  if (dual_head_norm->fused_backend->apply(res, call->queries.array, call->keys.array,
                                           call->queries.weight, call->keys.weight,
                                           dual_head_norm->rms_norm_epsilon) != 0) {
    return fail_in_mlx(error, APPLY_DUAL_HEAD_NORM_OPERATION);
  }
  return MLX_DUALNORM_OK;
}

/* Runs the plain or compiled closure of the call's weight layout under the
 * trace lock, with this object's epsilon in the slot. */
static int apply_graph(mlx_vector_array* res, mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                       const dual_head_norm_call* call, dual_head_norm_route route,
                       mlx_dualnorm_error* error) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  bool has_query_weight = call->queries.weight.ctx != NULL;
  bool has_key_weight = call->keys.weight.ctx != NULL;
  int layout = (has_query_weight ? QUERY_WEIGHTED_LAYOUT : 0) |
               (has_key_weight ? KEY_WEIGHTED_LAYOUT : 0);
  mlx_array graph_inputs[4] = {call->queries.array, call->keys.array};
  size_t input_count = 2;
  if (has_query_weight) {
    graph_inputs[input_count++] = call->queries.weight;
  }
  if (has_key_weight) {
    graph_inputs[input_count++] = call->keys.weight;
  }
  /* The vector takes its own references; the caller's handles stay
   * borrowed. Freed below on every path. */
  mlx_vector_array input_vector = mlx_vector_array_new_data(graph_inputs, input_count);
  if (input_vector.ctx == NULL) {
    return fail_in_mlx(error, operation);
  }
  pthread_mutex_lock(&trace_lock);
  int apply_status = 0;
  bool closed = dual_head_norm->closed;
  if (!closed) {
    store_baked_rms_norm_epsilon(dual_head_norm->rms_norm_epsilon);
    apply_status = mlx_closure_apply(res,
                                     route == PLAIN_GRAPH_ROUTE
                                         ? dual_head_norm->plain_graphs[layout]
                                         : dual_head_norm->compiled_graphs[layout],
                                     input_vector);
  }
  pthread_mutex_unlock(&trace_lock);
  int free_status = mlx_vector_array_free(input_vector);
  if (closed) {
    return fail_with(error, MLX_DUALNORM_CLOSED, operation, "the dual head norm is closed");
  }
  if (apply_status != 0 || free_status != 0) {
    return fail_in_mlx(error, operation);
  }
  return MLX_DUALNORM_OK;
}

int mlx_dualnorm_apply_compiled_dual_head_norm(
    mlx_vector_array* res, mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
    const mlx_array queries, const mlx_array keys, const mlx_array query_scale_weight,
    const mlx_array key_scale_weight, mlx_dualnorm_error* error) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  begin_call();
  if (res == NULL || dual_head_norm == NULL) {
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "the result vector or the dual head norm is NULL");
  }
  dual_head_norm_call call = {0};
  dual_head_norm_route route = COMPILED_GRAPH_ROUTE;
  int status = inspect_head_norm_input(&call.queries, "queries", queries,
                                       "query scale weight", query_scale_weight, error);
  if (status == MLX_DUALNORM_OK) {
    status = inspect_head_norm_input(&call.keys, "keys", keys, "key scale weight",
                                     key_scale_weight, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = check_float64_placement(&call, error);
  }
  if (status == MLX_DUALNORM_OK && (!register_applying_thread() || erase_queued_compile_ids() != 0)) {
    status = fail_in_mlx(error, operation);
  }
  if (status == MLX_DUALNORM_OK) {
    status = choose_route(dual_head_norm, &call, &route, error);
  }
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  return route == FUSED_KERNEL_ROUTE ? apply_fused_kernel(res, dual_head_norm, &call, error)
                                     : apply_graph(res, dual_head_norm, &call, route, error);
}

int mlx_dualnorm_compiled_dual_head_norm_close(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm, mlx_dualnorm_error* error) {
  begin_call();
  if (dual_head_norm == NULL) {
    return fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, CLOSE_DUAL_HEAD_NORM_OPERATION,
                     "the dual head norm is NULL");
  }
  pthread_mutex_lock(&trace_lock);
  int status = dual_head_norm->closed ? 0 : release_compiled_graphs(dual_head_norm);
  pthread_mutex_unlock(&trace_lock);
  return status == 0 ? MLX_DUALNORM_OK : fail_in_mlx(error, CLOSE_DUAL_HEAD_NORM_OPERATION);
}

void mlx_dualnorm_compiled_dual_head_norm_free(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  if (dual_head_norm == NULL) {
    return;
  }
  mlx_dualnorm_compiled_dual_head_norm_close(dual_head_norm, NULL);
  free(dual_head_norm);
}
