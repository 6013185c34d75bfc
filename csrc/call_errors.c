/* How the package's C entry points report failures: into the caller's
 * mlx_dualnorm_error, before they return (see call_errors.h). */
#include "private/call_errors.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

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

void dualnorm_begin_call(void) {
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

int dualnorm_fail_with(mlx_dualnorm_error* error, mlx_dualnorm_status status,
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

int dualnorm_fail_in_mlx(mlx_dualnorm_error* error, const char* operation) {
  return dualnorm_fail_with(error, MLX_DUALNORM_MLX_FAILURE, operation, "%s",
                   mlx_message.held ? mlx_message.text : "MLX failed without a message");
}

int dualnorm_free_vector_after(int status, mlx_vector_array vector, const char* operation,
                               mlx_dualnorm_error* error) {
  if (mlx_vector_array_free(vector) != 0 && status == MLX_DUALNORM_OK) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  return status;
}
