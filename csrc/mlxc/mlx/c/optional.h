/* Optional scalars (upstream mlx-c v0.6.0 names and layout): a value and
 * whether it is there. The subset carries the one its functions take. */
#ifndef MLX_OPTIONAL_H
#define MLX_OPTIONAL_H

#include <stdbool.h>

#include "mlx/c/array.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A float that may be absent: `value` is read only when `has_value`. */
typedef struct mlx_optional_float_ {
  float value;
  bool has_value;
} mlx_optional_float;

#ifdef __cplusplus
}
#endif

#endif
