/* The mlx-c subset this project carries: every header, as upstream's
 * mlx/c/mlx.h includes them all. Names, signatures, include guards and
 * behaviour follow upstream mlx-c v0.6.0; csrc/mlxc/mlx/c/private/mlx.h
 * lists where the subset reports an error where upstream's behaviour is
 * undefined. */
#ifndef MLX_ALL_H
#define MLX_ALL_H

#include "mlx/c/array.h"
#include "mlx/c/closure.h"
#include "mlx/c/compile.h"
#include "mlx/c/device.h"
#include "mlx/c/error.h"
#include "mlx/c/fast.h"
#include "mlx/c/ops.h"
#include "mlx/c/optional.h"
#include "mlx/c/stream.h"
#include "mlx/c/vector.h"

#endif
