/* Epsilon-specialized compiled composite fusing the q/k head
 * normalizations.
 *
 * The query/key head RMS normalizations of a layer's prework ran as two
 * graph builds; one dual-output replay of a compiled graph produces both.
 * Every primitive and its order match the composed path: the builder
 * calls mlx_fast_rms_norm on each input exactly as two separate calls
 * would, so MLX emits the same kernels over the same inputs.
 *
 * Constants at trace time: the builders are plain function pointers, so the
 * epsilon rides in a process-wide slot that each apply fills under the
 * trace lock; compile ids of each object's own, erased from every thread's
 * cache at close. docs/design.md ("Epsilon and constants at trace time")
 * says why, and how the norm + RoPE differs. In fused mode, supported
 * inputs skip the graph: the epsilon is a kernel argument.
 *
 * The graph is traced once per input shape (and dtype), not shapeless: a
 * shapeless trace cannot fold rms_norm's element count into a constant, so
 * it keeps two NumberOfElements primitives per call that a shaped trace
 * drops, and on MLX's CPU backend each one is a dispatch to the stream's
 * worker thread: the shaped trace is the faster, as fast as Python's
 * shaped mx.compile (docs/performance.md). Only calls of at most
 * COMPILED_GRAPH_MAX_ELEMENTS elements take the compiled graph, so the shapes
 * traced stay few (decode batch sizes), each traced once per thread; the
 * fused kernels MLX compiles for them are keyed by memory layout, not by
 * shape.
 *
 * The compiled graph pays off at decode sizes only: on CPU, MLX fuses the
 * fallback rms_norm ops into one generic kernel that is slower than the
 * composed ops beyond a few dozen rows. That kernel loses per element
 * while the graph saves a fixed number of dispatches, so the bound counts
 * elements: calls with more than COMPILED_GRAPH_MAX_ELEMENTS in all take
 * the uncompiled builder, which is the composed graph. The bound is where
 * the compiled graph stops being faster (docs/performance.md, "The
 * compiled graphs' bounds", has the measurements).
 *
 * Rows of width 0 or 1 take the uncompiled builder too: there is nothing
 * to gain for them, and MLX 0.32.4's compile mishandles them (shapeless,
 * the wrong shape for width 0 and a crash in its CPU sum for width 1 at
 * rank >= 2).
 *
 * rms_norm checks its arguments when traced, never at a replay, so the
 * apply checks rms_norm's preconditions on every call (head_norm_input.h),
 * and chooses the route (fused, compiled, uncompiled) from the facts read
 * there.
 * Failures are reported as call_errors.h says; compile ids and their
 * erasure from every thread's cache are compile_erasure.h's.
 */
#include "mlx_dualnorm/dual_head_norm.h"

#include "private/call_errors.h"
#include "private/compile_erasure.h"
#include "private/head_norm_input.h"
#include "private/weight_set_graphs.h"
#include "private/mode_choice.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The labels of the errors, as MLX writes "[rms_norm] ...": construction
 * and apply are the operation itself. */
static const char COMPILE_DUAL_HEAD_NORM_OPERATION[] = "dual_head_norm";
static const char APPLY_DUAL_HEAD_NORM_OPERATION[] = "dual_head_norm";
static const char CLOSE_DUAL_HEAD_NORM_OPERATION[] = "dual_head_norm_close";
static const char BUILD_DUAL_HEAD_NORM_GRAPH_OPERATION[] = "dual_head_norm_graph";

/* ---- The process-wide epsilon slot --------------------------------------- */

/* Written only under trace_lock, by the apply about to (maybe) trace; read by
 * the builders during that trace (docs/design.md). Atomic so a builder run
 * outside any apply still reads a whole value. */
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

/* Registration, mode resolution and which calls the kernel takes are
 * mode_choice.h's, shared with the norm + RoPE. */
static dualnorm_fused_registration fused_registration = {NULL};

void mlx_dualnorm_set_fused_backend(const mlx_dualnorm_fused_backend* backend) {
  dualnorm_register_fused_kernel(&fused_registration, backend == NULL ? NULL : &backend->kernel);
}

bool mlx_dualnorm_fused_mode_available(void) {
  return dualnorm_fused_kernel_available(&fused_registration);
}

/* ---- Graph builders ------------------------------------------------------ */

/* One side of the graph: an input and its weight (empty: none), both
 * borrowed from the closure's input vector by handles this builder owns. */
typedef struct graph_side {
  mlx_array input;
  mlx_array scale_weight;
} graph_side;

/* rms_norm of one side on the stream dualnorm_select_side_stream picks. */
static int normalize_side(mlx_array* normalized, const graph_side side,
                          const mlx_device default_device) {
  mlx_stream stream = mlx_stream_new();
  int status = dualnorm_select_side_stream(&stream, side.input, default_device) != 0 ||
               mlx_fast_rms_norm(normalized, side.input, side.scale_weight,
                                 baked_rms_norm_epsilon(), stream) != 0;
  status |= mlx_stream_free(stream);
  return status;
}

/* Inputs: queries, keys, then the query weight and the key weight where the
 * weight set has them. Output order is the caller's ABI: normalized queries
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

/* The builder of one weight set. A plain function pointer captures
 * nothing (see the file comment), so each weight set has a function of its
 * own, with the set's weights fixed in it: one definition for the four. */
#define DEFINE_WEIGHT_SET_GRAPH_BUILDER(name, weight_set)                                \
  static int name(mlx_vector_array* output_vector, const mlx_vector_array input_vector) { \
    return build_dual_head_norm_graph(output_vector, input_vector,                        \
                                      ((weight_set) & WEIGHT_SET_QUERY) != 0,             \
                                      ((weight_set) & WEIGHT_SET_KEY) != 0);              \
  }
DEFINE_WEIGHT_SET_GRAPH_BUILDER(build_weightless_graph, WEIGHT_SET_NONE)
DEFINE_WEIGHT_SET_GRAPH_BUILDER(build_query_weighted_graph, WEIGHT_SET_QUERY)
DEFINE_WEIGHT_SET_GRAPH_BUILDER(build_key_weighted_graph, WEIGHT_SET_KEY)
DEFINE_WEIGHT_SET_GRAPH_BUILDER(build_weighted_graph, WEIGHT_SET_BOTH)
#undef DEFINE_WEIGHT_SET_GRAPH_BUILDER

static int (*const graph_builders[WEIGHT_SET_COUNT])(mlx_vector_array*,
                                                      const mlx_vector_array) = {
    [WEIGHT_SET_NONE] = build_weightless_graph,
    [WEIGHT_SET_QUERY] = build_query_weighted_graph,
    [WEIGHT_SET_KEY] = build_key_weighted_graph,
    [WEIGHT_SET_BOTH] = build_weighted_graph,
};

/* The plain builder of one weight set: a plain function, which reads the
 * epsilon from the slot (the owner is not needed). */
static mlx_closure new_plain_graph(const void* owner, int weight_set) {
  (void)owner;
  return mlx_closure_new_func(graph_builders[weight_set]);
}

/* ---- The compiled dual head norm ----------------------------------------- */

struct mlx_dualnorm_compiled_dual_head_norm_ {
  /* Owned closures, one per weight set: the plain builders (run in
   * composed mode and for widths <= 1) and their compiled forms (empty in
   * composed mode). All empty once closed. Read and released only under
   * trace_lock. */
  dualnorm_weight_set_graphs graphs;
  float rms_norm_epsilon;
  mlx_dualnorm_mode mode;
  /* In FUSED mode, the backend resolved at construction (never NULL). */
  const mlx_dualnorm_fused_backend* fused_backend;
  /* Written under trace_lock; atomic so the fused path may read it without. */
  atomic_bool closed;
};

mlx_dualnorm_mode mlx_dualnorm_compiled_dual_head_norm_mode(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  return dual_head_norm == NULL ? MLX_DUALNORM_MODE_AUTO : dual_head_norm->mode;
}

float mlx_dualnorm_compiled_dual_head_norm_epsilon(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  return dual_head_norm == NULL ? NAN : dual_head_norm->rms_norm_epsilon;
}

/* Frees the compiled graphs and erases their traces from every thread's
 * cache; the caller holds trace_lock or is the only user. */
static int release_compiled_graphs(mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  int status = dualnorm_release_weight_set_graphs(&dual_head_norm->graphs);
  dual_head_norm->closed = true;
  return status;
}

/* Builds the plain and (unless composed) compiled closure of every weight set,
 * the epsilon's bits as the compile constant. */
static int compile_graphs(mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  float rms_norm_epsilon = dual_head_norm->rms_norm_epsilon;
  uint32_t epsilon_bits;
  memcpy(&epsilon_bits, &rms_norm_epsilon, sizeof epsilon_bits);
  const uint64_t compile_constants[1] = {epsilon_bits};
  return dualnorm_compile_weight_set_graphs(&dual_head_norm->graphs, dual_head_norm->mode,
                                            new_plain_graph, dual_head_norm, compile_constants,
                                            1);
}

int mlx_dualnorm_compiled_dual_head_norm_new(mlx_dualnorm_compiled_dual_head_norm** res,
                                             double rms_norm_epsilon, mlx_dualnorm_mode mode,
                                             mlx_dualnorm_error* error) {
  const char* operation = COMPILE_DUAL_HEAD_NORM_OPERATION;
  dualnorm_begin_call();
  if (res == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "the result pointer is NULL");
  }
  int status = dualnorm_check_rms_norm_epsilon(rms_norm_epsilon, operation, error);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  mlx_dualnorm_mode resolved_mode = MLX_DUALNORM_MODE_COMPILED;
  const mlx_dualnorm_fused_kernel* fused_kernel = NULL;
  status = dualnorm_resolve_mode(mode, &fused_registration, operation, &resolved_mode,
                                 &fused_kernel, error);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  mlx_dualnorm_compiled_dual_head_norm* dual_head_norm = calloc(1, sizeof *dual_head_norm);
  if (dual_head_norm == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_MLX_FAILURE, operation, "out of host memory");
  }
  dual_head_norm->rms_norm_epsilon = (float)rms_norm_epsilon;
  dual_head_norm->mode = resolved_mode;
  /* The kernel is its table's first member (mode_choice.h). */
  dual_head_norm->fused_backend = (const mlx_dualnorm_fused_backend*)fused_kernel;
  status = compile_graphs(dual_head_norm) == 0 ? MLX_DUALNORM_OK
                                               : dualnorm_fail_in_mlx(error, operation);
  if (status != MLX_DUALNORM_OK) {
    mlx_dualnorm_compiled_dual_head_norm_free(dual_head_norm); /* releases what was built */
    return status;
  }
  *res = dual_head_norm;
  return MLX_DUALNORM_OK;
}

/* ---- Applying: one route per call ---------------------------------------- */

/* 48 rows of 128 (see the file comment). */
enum { COMPILED_GRAPH_MAX_ELEMENTS = 6144 };

typedef enum dual_head_norm_route {
  FUSED_KERNEL_ROUTE,
  COMPILED_GRAPH_ROUTE,
  /* The plain builder: the composed graph (see the file comment for when). */
  PLAIN_GRAPH_ROUTE,
} dual_head_norm_route;

/* Whether the fused kernel computes exactly what rms_norm would: the
 * inputs fit the kernel (mode_choice.h), the CUDA GPU by default. */
static int fused_kernel_takes(const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                              dual_head_norm_call* call, bool* takes,
                              mlx_dualnorm_error* error) {
  *takes = dualnorm_fused_kernel_fits(&dual_head_norm->fused_backend->kernel, call);
  return *takes ? dualnorm_default_device_is_gpu(call, APPLY_DUAL_HEAD_NORM_OPERATION, takes,
                                                 error)
                : MLX_DUALNORM_OK;
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
               queries->size + keys->size > COMPILED_GRAPH_MAX_ELEMENTS;
  *route = plain ? PLAIN_GRAPH_ROUTE : COMPILED_GRAPH_ROUTE;
  return MLX_DUALNORM_OK;
}

/* No graph, so no trace and no lock: the epsilon is a kernel argument, and
 * closing frees no state this launch uses. */
static int apply_fused_kernel(mlx_vector_array* res,
                              const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                              const dual_head_norm_call* call, mlx_dualnorm_error* error) {
  if (dual_head_norm->closed) {
    return dualnorm_fail_with(error, MLX_DUALNORM_CLOSED, APPLY_DUAL_HEAD_NORM_OPERATION,
                     "the dual head norm is closed");
  }
  if (dual_head_norm->fused_backend->apply(res, call->queries.array, call->keys.array,
                                           call->queries.weight, call->keys.weight,
                                           dual_head_norm->rms_norm_epsilon) != 0) {
    return dualnorm_fail_in_mlx(error, APPLY_DUAL_HEAD_NORM_OPERATION);
  }
  return MLX_DUALNORM_OK;
}

/* Runs the plain or compiled closure of the call's weight set under the
 * trace lock, with this object's epsilon in the slot. */
static int apply_graph(mlx_vector_array* res, mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
                       const dual_head_norm_call* call, dual_head_norm_route route,
                       mlx_dualnorm_error* error) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  int weight_set = WEIGHT_SET_NONE;
  /* Owned here, freed below on every path. */
  mlx_vector_array input_vector = dualnorm_graph_inputs(call, NULL, &weight_set);
  if (input_vector.ctx == NULL) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  pthread_mutex_lock(&trace_lock);
  int apply_status = 0;
  bool closed = dual_head_norm->closed;
  if (!closed) {
    store_baked_rms_norm_epsilon(dual_head_norm->rms_norm_epsilon);
    apply_status = mlx_closure_apply(res,
                                     route == PLAIN_GRAPH_ROUTE
                                         ? dual_head_norm->graphs.plain[weight_set]
                                         : dual_head_norm->graphs.compiled[weight_set],
                                     input_vector);
  }
  pthread_mutex_unlock(&trace_lock);
  int free_status = mlx_vector_array_free(input_vector);
  if (closed) {
    return dualnorm_fail_with(error, MLX_DUALNORM_CLOSED, operation, "the dual head norm is closed");
  }
  if (apply_status != 0 || free_status != 0) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  return MLX_DUALNORM_OK;
}

int mlx_dualnorm_compiled_dual_head_norm_apply(
    mlx_vector_array* res, mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
    const mlx_array queries, const mlx_array keys, const mlx_array query_scale_weight,
    const mlx_array key_scale_weight, mlx_dualnorm_error* error) {
  const char* operation = APPLY_DUAL_HEAD_NORM_OPERATION;
  dualnorm_begin_call();
  if (res == NULL || dual_head_norm == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                     "the result vector or the dual head norm is NULL");
  }
  dual_head_norm_call call = {0};
  dual_head_norm_route route = COMPILED_GRAPH_ROUTE;
  int status = dualnorm_inspect_head_norm_input(&call.queries, operation, "queries", queries,
                                                "query_weight", query_scale_weight, false,
                                                error);
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_inspect_head_norm_input(&call.keys, operation, "keys", keys,
                                              "key_weight", key_scale_weight, false, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_check_float64_placement(&call, operation, error);
  }
  if (status == MLX_DUALNORM_OK &&
      (!dualnorm_register_applying_thread(dual_head_norm->graphs.compile_ids) ||
       dualnorm_erase_queued_compile_ids() != 0)) {
    status = dualnorm_fail_in_mlx(error, operation);
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
  dualnorm_begin_call();
  if (dual_head_norm == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, CLOSE_DUAL_HEAD_NORM_OPERATION,
                     "the dual head norm is NULL");
  }
  pthread_mutex_lock(&trace_lock);
  int status = dual_head_norm->closed ? 0 : release_compiled_graphs(dual_head_norm);
  pthread_mutex_unlock(&trace_lock);
  return status == 0 ? MLX_DUALNORM_OK : dualnorm_fail_in_mlx(error, CLOSE_DUAL_HEAD_NORM_OPERATION);
}

void mlx_dualnorm_compiled_dual_head_norm_free(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm) {
  if (dual_head_norm == NULL) {
    return;
  }
  mlx_dualnorm_compiled_dual_head_norm_close(dual_head_norm, NULL);
  free(dual_head_norm);
}
