/* mlx_stream over mlx::core::Stream, behaving as upstream's stream.cpp. */
#include "mlx/c/stream.h"
#include "mlx/c/private/mlx.h"

using namespace bundled_mlx_c;

extern "C" mlx_stream mlx_stream_new(void) {
  return mlx_stream{nullptr};
}

extern "C" int mlx_stream_free(mlx_stream stream) {
  return free_handle(stream);
}

extern "C" int mlx_get_default_stream(mlx_stream* stream, mlx_device dev) {
  return status_of([&] { store(stream, mx::default_stream(object_of(dev))); });
}

extern "C" mlx_stream mlx_default_cpu_stream_new(void) {
  return value_or(mlx_stream{nullptr},
      [] { return new_handle<mlx_stream>(mx::default_stream(mx::Device::cpu)); });
}

extern "C" mlx_stream mlx_default_gpu_stream_new(void) {
  return value_or(mlx_stream{nullptr},
      [] { return new_handle<mlx_stream>(mx::default_stream(mx::Device::gpu)); });
}
