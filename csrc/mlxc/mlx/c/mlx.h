/* The mlx-c subset this project carries: every header, as upstream's
 * mlx/c/mlx.h includes them all. */
#ifndef MLX_C_MLX_H
#define MLX_C_MLX_H

#include "mlx/c/array.h"
#include "mlx/c/closure.h"
#include "mlx/c/compile.h"
#include "mlx/c/device.h"
#include "mlx/c/error.h"
#include "mlx/c/fast.h"
#include "mlx/c/stream.h"
#include "mlx/c/vector.h"

#endif
