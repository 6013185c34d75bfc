/* MLX streams (upstream mlx-c v0.6.0 names and signatures). */
#ifndef MLX_STREAM_H
#define MLX_STREAM_H

#include "mlx/c/device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ctx owns a heap mlx::core::Stream; empty when ctx is NULL. */
typedef struct mlx_stream_ {
  void* ctx;
} mlx_stream;

mlx_stream mlx_stream_new(void);
int mlx_stream_free(mlx_stream stream);

/* Sets `*stream` to the calling thread's default stream on `dev`. */
int mlx_get_default_stream(mlx_stream* stream, mlx_device dev);

/* The calling thread's default CPU / GPU stream, or an empty handle (with an
 * error reported) when MLX has no such backend, e.g. a GPU stream on a
 * CPU-only build. */
mlx_stream mlx_default_cpu_stream_new(void);
mlx_stream mlx_default_gpu_stream_new(void);

#ifdef __cplusplus
}
#endif

#endif
