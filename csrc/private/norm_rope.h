/* The dual head norm + RoPE's parts that its files share (internal).
 *
 *   dual_head_norm_rope.c        the object, its entry points and routes
 *   norm_rope_graph.c            the graph builder and its input vector
 *   norm_rope_checks.c           every input read and checked once; the
 *                                fused kernel's conditions; the route
 *   dual_head_norm_rope_cache.c  the KV-cache write
 *
 * dual_head_norm_rope.c's file comment says what the composite does and
 * why; each declaration here says what its function owns and frees. A file
 * that includes this header defines _POSIX_C_SOURCE first (the object holds
 * POSIX locks, which a strict -std=c11 hides).
 */
#ifndef MLX_DUALNORM_PRIVATE_NORM_ROPE_H
#define MLX_DUALNORM_PRIVATE_NORM_ROPE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#include "dual_head_norm_rope.h"
#include "dual_head_norm_rope_cache.h"

#include "private/head_norm_input.h"
#include "private/weight_set_graphs.h"

/* The labels of the errors, as MLX writes "[rope] ...": construction and
 * apply are the operation itself (defined in dual_head_norm_rope.c). */
extern const char DUALNORM_NORM_ROPE_OPERATION[];       /* new, apply */
extern const char DUALNORM_NORM_ROPE_CACHE_OPERATION[]; /* apply with a cache write */

enum {
  /* (batch, sequence, heads, head dim): the rank of every input but the
   * offset, the weights and the table. */
  ATTENTION_INPUT_RANK = 4,
  /* The compiled graphs' bound, with or without the cache write, in
   * elements of queries and keys together: 128 rows of 128. Larger calls
   * (prefill) take the plain builder (dual_head_norm_rope.c says why). */
  COMPILED_GRAPH_MAX_ELEMENTS = 16384,
  /* The norm + RoPE graph's inputs: queries, keys and the RoPE offset
   * always, then at most the two weights and the frequency table. */
  NORM_ROPE_FIXED_INPUTS = 3,
  NORM_ROPE_MAX_INPUTS = NORM_ROPE_FIXED_INPUTS + 3,
  /* The cache graph's inputs past the norm + RoPE's, in this order:
   * values, key_cache, value_cache, the write offset. */
  CACHE_GRAPH_EXTRA_INPUTS = 4,
};

/* (B, L, H, D) -> (B, H, L, D), as mlx-lm's attention transposes. */
extern const int DUALNORM_HEAD_MAJOR_AXES[ATTENTION_INPUT_RANK];

/* What one closure's builder reads at trace time: a copy per closure,
 * owned by the closure (freed with its last copy). */
typedef struct norm_rope_constants {
  float rms_norm_epsilon;
  mlx_dualnorm_rope_parameters rope;
  bool has_query_weight;
  bool has_key_weight;
} norm_rope_constants;

/* What one call knows about the RoPE offset, read once. */
typedef struct rope_offset_input {
  size_t rank;
  size_t size;
} rope_offset_input;

/* What the checks read of one call's inputs, once, and the route they
 * choose: `fused` where FUSED mode's kernel takes the call. */
typedef struct norm_rope_facts {
  dual_head_norm_call sides;
  rope_offset_input offset;
  bool fused;
} norm_rope_facts;

struct mlx_dualnorm_dual_head_norm_rope_ {
  /* Owned closures, one per weight set: the plain builders (composed
   * mode, prefill sizes, empty inputs) and their compiled forms (empty in
   * composed mode). All empty once closed. Used under lifetime_lock's read
   * side, released under its write side. */
  dualnorm_weight_set_graphs graphs;
  float rms_norm_epsilon;
  mlx_dualnorm_rope_parameters rope;
  mlx_dualnorm_mode mode;
  /* In FUSED mode, the backend resolved at construction (never NULL). */
  const mlx_dualnorm_fused_rope_backend* fused_backend;
  /* The graphs of a call with a cache write (the norm + RoPE and the two
   * writes), per weight set, kept as `graphs` is. */
  dualnorm_weight_set_graphs cache_graphs;
  /* The last write position as an int32 scalar (owned; empty until the
   * first cache write), reused while the position stays the same: every
   * layer of a decode step writes at the same row. Guarded by
   * write_offset_lock; graphs holding an older scalar keep it alive. */
  pthread_mutex_t write_offset_lock;
  int write_offset_value;
  mlx_array write_offset_scalar;
  /* Applies hold it shared, close exclusively: close waits for applies in
   * flight, and applies of one object on several threads run together. */
  pthread_rwlock_t lifetime_lock;
  bool closed; /* written under the exclusive lock */
};

/* ---- norm_rope_graph.c ---------------------------------------------------- */

/* A builder closure's function: inputs borrowed (the closure's), outputs
 * published into `*output_vector` once at the end, `payload` the closure's
 * norm_rope_constants. */
typedef int (*dualnorm_norm_rope_builder)(mlx_vector_array* output_vector,
                                          const mlx_vector_array input_vector, void* payload);

/* The plain norm + RoPE builder: inputs in dualnorm_norm_rope_graph_inputs's
 * order; outputs the rotated queries, then the rotated keys. */
int dualnorm_build_norm_rope_graph(mlx_vector_array* output_vector,
                                   const mlx_vector_array input_vector, void* payload);

/* The inputs of a norm + RoPE graph of these constants' weight set. */
size_t dualnorm_norm_rope_input_count(const norm_rope_constants* constants);

/* Whether a builder got an output vector and `expected_inputs` inputs;
 * else the reason sent to mlx_error, false. */
bool dualnorm_graph_inputs_expected(const mlx_vector_array* output_vector,
                                    const mlx_vector_array input_vector, size_t expected_inputs);

/* A plain closure of `builder` for one weight set of `norm_rope`, carrying
 * its own copy of the constants (an empty handle, with the reason sent to
 * mlx_error, on failure). */
mlx_closure dualnorm_new_norm_rope_closure(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                           int weight_set, dualnorm_norm_rope_builder builder);

/* The norm + RoPE graph's input vector (owned by the caller): queries,
 * keys, the RoPE offset, the call's weights, then the table where the call
 * has one (the builder's input order); `*weight_set` the call's. The
 * vector takes its own references. An empty handle, with the reason sent
 * to mlx_error, on failure. */
mlx_vector_array dualnorm_norm_rope_graph_inputs(const dual_head_norm_call* sides,
                                                 const mlx_dualnorm_rope_inputs* inputs,
                                                 int* weight_set);

/* ---- norm_rope_checks.c --------------------------------------------------- */

/* The constructor's argument checks, before anything is allocated. */
int dualnorm_check_norm_rope_constants(double rms_norm_epsilon,
                                       const mlx_dualnorm_rope_parameters* rope,
                                       mlx_dualnorm_error* error);

/* A call's start and route, failures labelled `operation`: the pointers,
 * every input read and checked once into `*facts` (the cache write's too,
 * where `cache_write` is not NULL), the thread noted as applying the
 * graphs the call may run (its queued erasures done), then `facts->fused`
 * set where FUSED mode's kernel takes the call. Nothing is built. */
int dualnorm_check_norm_rope_call(const mlx_vector_array* res,
                                  const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                  const mlx_dualnorm_rope_inputs* inputs,
                                  const mlx_dualnorm_cache_write* cache_write,
                                  const char* operation, norm_rope_facts* facts,
                                  mlx_dualnorm_error* error);

/* The compiled graph for decode-sized, non-empty calls, with or without the
 * cache write; the plain builder otherwise. */
bool dualnorm_takes_compiled_graph(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                   const dual_head_norm_call* sides);

/* Whether the fused backend writes the cache in the norm + RoPE's launch:
 * it can, and the values and both buffers have the queries' dtype (a
 * write that casts takes MLX's slice updates, which cast as indexing
 * does). */
bool dualnorm_one_launch_writes_cache(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                      const dual_head_norm_call* sides,
                                      const mlx_dualnorm_cache_write* cache_write);

/* ---- dual_head_norm_rope.c ------------------------------------------------ */

/* One launch of the fused backend, the object held open for the duration:
 * no graph, so no trace; the constants are kernel arguments. With
 * `cache_write` (else NULL) the launch also writes the KV cache. `*res` as
 * the backend's apply sets it; failures labelled `operation`. */
int dualnorm_apply_fused_norm_rope(mlx_vector_array* res,
                                   mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                   const mlx_dualnorm_rope_inputs* inputs,
                                   const mlx_dualnorm_cache_write* cache_write,
                                   const char* operation, mlx_dualnorm_error* error);

/* Runs the closure of `graphs` (the object's norm + RoPE or cache graphs)
 * for `weight_set`, compiled or plain (dualnorm_takes_compiled_graph), on
 * `inputs` (borrowed), the object held open for the duration. */
int dualnorm_run_weight_set_graph(mlx_vector_array* res,
                                  mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                  const dualnorm_weight_set_graphs* graphs,
                                  const dual_head_norm_call* sides, int weight_set,
                                  const mlx_vector_array inputs, const char* operation,
                                  mlx_dualnorm_error* error);

/* ---- dual_head_norm_rope_cache.c ------------------------------------------ */

/* The plain cache builder of one weight set, as the norm + RoPE's. */
mlx_closure dualnorm_new_plain_cache_graph(const void* owner, int weight_set);

/* The route of a call with a cache write, its checks done (`facts`): the
 * fused launch with the write where it takes it, else the fused launch or
 * the cache graph, then MLX's slice updates, then with `fetch` the rows
 * fetched. `*res` is set only on success. */
int dualnorm_apply_norm_rope_with_cache(mlx_vector_array* res,
                                        mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                        const norm_rope_facts* facts,
                                        const mlx_dualnorm_rope_inputs* inputs,
                                        const mlx_dualnorm_cache_write* cache_write,
                                        mlx_dualnorm_error* error);

#endif
