/* mlx_device over mlx::core::Device. */
#include "mlx/c/device.h"
#include "mlx/c/private/mlx.h"

using namespace mlx_c_private;

extern "C" mlx_device mlx_device_new(void) {
  return mlx_device{nullptr};
}

extern "C" mlx_device mlx_device_new_type(mlx_device_type type, int index) {
  return guarded_new<mlx_device, mx::Device>([&] {
    return mx::Device(type == MLX_GPU ? mx::Device::gpu : mx::Device::cpu, index);
  });
}

extern "C" int mlx_device_free(mlx_device dev) {
  return guarded([&] { release<mx::Device>(dev); });
}

extern "C" int mlx_get_default_device(mlx_device* dev) {
  return guarded([&] { assign(dev, mx::default_device(), "mlx_get_default_device"); });
}

extern "C" int mlx_device_get_type(mlx_device_type* type, mlx_device dev) {
  return guarded([&] {
    const char* c_function = "mlx_device_get_type";
    if (type == nullptr) {
      throw std::invalid_argument("[mlx_device_get_type] NULL result pointer");
    }
    *type = held<mx::Device>(dev, c_function).type == mx::Device::gpu ? MLX_GPU : MLX_CPU;
  });
}
