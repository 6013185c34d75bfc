/* The last position's int32 scalar, held once for the process
 * (private/position_scalar.h).
 */
#include "private/position_scalar.h"

#include <pthread.h>
#include <stdint.h>

/* Guards the two below. The scalar is owned here and never freed: a
 * process holds one, and nothing runs at exit. */
static pthread_mutex_t last_position_lock = PTHREAD_MUTEX_INITIALIZER;
static int last_position = 0;
static mlx_array last_position_scalar = {NULL};

int dualnorm_position_scalar(mlx_array* res, int position) {
  pthread_mutex_lock(&last_position_lock);
  int status = 0;
  if (last_position_scalar.ctx == NULL || last_position != position) {
    int32_t value = position;
    mlx_array scalar = mlx_array_new_data(&value, NULL, 0, MLX_INT32);
    if (scalar.ctx == NULL) {
      status = 1;
    } else {
      /* Graphs and callers holding the old scalar keep it alive. */
      status = mlx_array_free(last_position_scalar) != 0;
      last_position_scalar = scalar; /* owned here from now on */
      last_position = position;
    }
  }
  if (status == 0) {
    status = mlx_array_set(res, last_position_scalar) != 0;
  }
  pthread_mutex_unlock(&last_position_lock);
  return status;
}
