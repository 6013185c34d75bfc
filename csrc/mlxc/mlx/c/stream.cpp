/* mlx_stream over mlx::core::Stream. */
#include "mlx/c/stream.h"
#include "mlx/c/private/mlx.h"

using namespace mlx_c_private;

extern "C" mlx_stream mlx_stream_new(void) {
  return mlx_stream{nullptr};
}

extern "C" int mlx_stream_free(mlx_stream stream) {
  return guarded([&] { release<mx::Stream>(stream); });
}

extern "C" int mlx_get_default_stream(mlx_stream* stream, mlx_device dev) {
  return guarded([&] {
    const char* c_function = "mlx_get_default_stream";
    assign(stream, mx::default_stream(held<mx::Device>(dev, c_function)), c_function);
  });
}

extern "C" mlx_stream mlx_default_cpu_stream_new(void) {
  return guarded_new<mlx_stream, mx::Stream>([] { return mx::default_stream(mx::Device::cpu); });
}

extern "C" mlx_stream mlx_default_gpu_stream_new(void) {
  return guarded_new<mlx_stream, mx::Stream>([] { return mx::default_stream(mx::Device::gpu); });
}
