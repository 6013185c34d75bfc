/* mlx_device over mlx::core::Device, behaving as upstream's device.cpp. */
#include "mlx/c/device.h"
#include "mlx/c/private/mlx.h"

using namespace bundled_mlx_c;

extern "C" mlx_device mlx_device_new(void) {
  return mlx_device{nullptr};
}

extern "C" mlx_device mlx_device_new_type(mlx_device_type type, int index) {
  return value_or(mlx_device{nullptr}, [&] {
    return new_handle<mlx_device>(
        mx::Device(type == MLX_GPU ? mx::Device::gpu : mx::Device::cpu, index));
  });
}

extern "C" int mlx_device_free(mlx_device dev) {
  return free_handle(dev);
}

extern "C" int mlx_get_default_device(mlx_device* dev) {
  return status_of([&] { store(dev, mx::default_device()); });
}

/* Upstream dereferences a NULL `type`; here it is a reported error. */
extern "C" int mlx_device_get_type(mlx_device_type* type, mlx_device dev) {
  return status_of([&] {
    if (type == nullptr) {
      throw std::invalid_argument("expected a non-NULL mlx_device_type*");
    }
    *type = object_of(dev).type == mx::Device::gpu ? MLX_GPU : MLX_CPU;
  });
}
