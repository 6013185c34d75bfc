/* The process-wide error handler slot of the mlx-c subset. */
#include <cstdarg>
#include <cstdio>
#include <mutex>

#include "mlx/c/error.h"
#include "mlx/c/private/mlx.h"

namespace {

/* Writes to stderr and RETURNS: unlike upstream's default, which exits, a
 * library caller keeps control and sees the failing return code. */
void print_error(const char* msg, void*) {
  std::fprintf(stderr, "mlx-c error: %s\n", msg);
}

struct ErrorHandlerSlot {
  mlx_error_handler_func handler = print_error;
  void* data = nullptr;
  void (*dtor)(void*) = nullptr;
};

std::mutex error_handler_mutex;
ErrorHandlerSlot error_handler_slot;

} // namespace

extern "C" void mlx_set_error_handler(
    mlx_error_handler_func handler,
    void* data,
    void (*dtor)(void*)) {
  ErrorHandlerSlot previous;
  {
    std::lock_guard<std::mutex> lock(error_handler_mutex);
    previous = error_handler_slot;
    error_handler_slot =
        ErrorHandlerSlot{handler ? handler : print_error, data, dtor};
  }
  if (previous.dtor != nullptr) {
    previous.dtor(previous.data);
  }
}

extern "C" void _mlx_error(const char* file, const int line, const char* fmt, ...) {
  char message[2048];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);
  ErrorHandlerSlot slot;
  {
    std::lock_guard<std::mutex> lock(error_handler_mutex);
    slot = error_handler_slot;
  }
  (void)file;
  (void)line;
  slot.handler(message, slot.data);
}

void mlx_c_private::report_exception(const std::exception& e) {
  _mlx_error(__FILE__, __LINE__, "%s", e.what());
}
