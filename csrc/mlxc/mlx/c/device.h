/* MLX devices (upstream mlx-c v0.6.0 names and signatures). */
#ifndef MLX_DEVICE_H
#define MLX_DEVICE_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mlx_device_type_ { MLX_CPU, MLX_GPU } mlx_device_type;

/* ctx owns a heap mlx::core::Device; empty when ctx is NULL. */
typedef struct mlx_device_ {
  void* ctx;
} mlx_device;

mlx_device mlx_device_new(void);
mlx_device mlx_device_new_type(mlx_device_type type, int index);
int mlx_device_free(mlx_device dev);

/* Sets `*dev` to the calling thread's default device. */
int mlx_get_default_device(mlx_device* dev);
int mlx_device_get_type(mlx_device_type* type, mlx_device dev);

#ifdef __cplusplus
}
#endif

#endif
