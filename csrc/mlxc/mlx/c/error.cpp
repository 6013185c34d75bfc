/* The process-wide error handler slot of the mlx-c subset. Behaves as
 * upstream's error.cpp: the default handler prints "MLX error: <message>"
 * to stdout and exits; messages carry " at FILE:LINE". Unlike upstream, the
 * slot is guarded by a mutex, and a handler's data stays alive while a call
 * to that handler is running even if another thread replaces it. */
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "mlx/c/error.h"

namespace {

void print_and_exit(const char* msg, void*) {
  std::printf("MLX error: %s\n", msg);
  std::exit(-1);
}

struct ErrorHandlerSlot {
  mlx_error_handler_func handler = print_and_exit;
  /* Owns the data when a dtor was given; otherwise a non-owning pointer. */
  std::shared_ptr<void> data;
};

std::mutex error_handler_mutex;
ErrorHandlerSlot error_handler_slot;

ErrorHandlerSlot installed_slot() {
  std::lock_guard<std::mutex> lock(error_handler_mutex);
  return error_handler_slot;
}

/* `fmt` applied to `args`, then " at FILE:LINE". */
std::string located_message(const char* file, int line, const char* fmt, va_list args) {
  va_list measuring;
  va_copy(measuring, args);
  const int length = std::vsnprintf(nullptr, 0, fmt, measuring);
  va_end(measuring);
  std::string message(length > 0 ? static_cast<size_t>(length) : 0, '\0');
  if (length > 0) {
    std::vsnprintf(message.data(), message.size() + 1, fmt, args);
  }
  return message + " at " + file + ":" + std::to_string(line);
}

} // namespace

extern "C" void mlx_set_error_handler(
    mlx_error_handler_func handler,
    void* data,
    void (*dtor)(void*)) {
  ErrorHandlerSlot replacement{
      handler != nullptr ? handler : print_and_exit,
      dtor != nullptr ? std::shared_ptr<void>(data, dtor)
                      : std::shared_ptr<void>(data, [](void*) {})};
  ErrorHandlerSlot previous;
  {
    std::lock_guard<std::mutex> lock(error_handler_mutex);
    previous = std::move(error_handler_slot);
    error_handler_slot = std::move(replacement);
  }
  // `previous` goes out of scope here, outside the lock: the old data's
  // dtor runs now, or when the last running call to its handler returns.
}

extern "C" void _mlx_error(const char* file, const int line, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  const std::string message = located_message(file, line, fmt, args);
  va_end(args);
  const ErrorHandlerSlot slot = installed_slot();
  slot.handler(message.c_str(), slot.data.get());
}
