#pragma once
// The test MLP (mlp.hpp) with its parameters on a fake device (tests/support/fake_device.hpp): each leaf is a view
// of device memory (values and gradient) that data_parallel adopts into its device arenas. The forward and the
// backward run as kernels on the device's stream, layer by layer, and the host reports each layer's gradients
// after enqueueing its backward, as a framework's autograd does: whatever ddp does with a gradient must be
// ordered after the kernel that wrote it, or the fake device faults or gives a wrong value.

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/visit.hpp>
#include <ddp/memory/domain.hpp>

#include "mlp.hpp"
#include "support/fake_device.hpp"

namespace ddp_test {

/// A parameter of element type T on a device: views of its values and gradient there (copied by value into
/// kernels).
template <class T>
struct device_param_of {
  T* values = nullptr;
  T* grads = nullptr;
  std::vector<std::size_t> shape;
  ddp::device where = ddp::device::cuda(0);
  [[nodiscard]] std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (const auto d : shape) n *= d;
    return n;
  }
  /// The values (device memory: touch them inside a kernel only).
  [[nodiscard]] std::span<T> value() const noexcept { return {values, numel()}; }
  /// The gradient (device memory: touch it inside a kernel only).
  [[nodiscard]] std::span<T> grad() const noexcept { return {grads, numel()}; }
  /// The values as a tensor of the device.
  [[nodiscard]] ddp::raw_tensor value_tensor() const noexcept { return {values, numel(), ddp::dtype_v<T>, where}; }
  /// Both, as tensors a kernel opens.
  [[nodiscard]] std::vector<ddp::raw_tensor> ranges() const {
    return {value_tensor(), {grads, numel(), ddp::dtype_v<T>, where}};
  }
};
using device_param = device_param_of<float>;

template <class T>
struct device_linear_of {
  device_param_of<T> weight, bias;
  /// Every range of the layer, for a kernel to open.
  [[nodiscard]] std::vector<ddp::raw_tensor> ranges() const {
    auto out = weight.ranges();
    for (const auto& r : bias.ranges()) out.push_back(r);
    return out;
  }
};
using device_linear = device_linear_of<float>;
template <class T>
struct device_mlp_of {
  device_linear_of<T> fc1, fc2, fc3;
};
using device_mlp = device_mlp_of<float>;

}  // namespace ddp_test

template <class T>
struct ddp::storage_traits<ddp_test::device_param_of<T>> {
  using param = ddp_test::device_param_of<T>;
  static ddp::dtype dtype(const param&) { return ddp::dtype_v<T>; }
  static std::vector<std::size_t> shape(const param& p) { return p.shape; }
  static void* values(param& p) { return p.values; }
  static void* grads(param& p) { return p.grads; }
  static ddp::device device(const param& p) { return p.where; }
  static void adopt(param& p, void* values, void* grads) {
    p.values = static_cast<T*>(values);
    p.grads = static_cast<T*>(grads);
  }
};

namespace ddp_test {

/// Calls `f(host parameter, device parameter, its device)` for the six parameters of `host` and `device` in pairs.
template <class Host, class Device, class F>
void pair_up(Host& host, Device& device, ddp::memory_domain& dev, ddp::memory_domain& last, F&& f) {
  f(host.fc1.weight, device.fc1.weight, dev);
  f(host.fc1.bias, device.fc1.bias, dev);
  f(host.fc2.weight, device.fc2.weight, dev);
  f(host.fc2.bias, device.fc2.bias, dev);
  f(host.fc3.weight, device.fc3.weight, last);
  f(host.fc3.bias, device.fc3.bias, last);
}

/// A device copy of `host` (an MLP of T parameters) on `dev` (fc1 and fc2 there, fc3 on `last`: a model split over
/// two devices when they differ), with the device memory it owns: any device's memory domain (a fake device, a GPU).
template <class T>
struct device_model_of {
  device_mlp_of<T> model;
  std::vector<ddp::domain_buffer> memory;

  template <class Host>
  device_model_of(Host& host, ddp::memory_domain& dev, ddp::memory_domain& last) {
    auto place = [&](ddp::parameter<T>& from, device_param_of<T>& to, ddp::memory_domain& d) {
      const std::size_t bytes = from.numel() * sizeof(T);
      memory.push_back(d.allocate(bytes));
      memory.push_back(d.allocate(bytes));
      to.values = reinterpret_cast<T*>(memory[memory.size() - 2].data());
      to.grads = reinterpret_cast<T*>(memory.back().data());
      to.shape = from.shape();
      to.where = d.where();
      d.copy(ddp::raw_tensor::of(from.value()), to.value_tensor());
      d.synchronize();
    };
    pair_up(host, model, dev, last, place);
  }
};
using device_model = device_model_of<float>;

/// The values of `m`'s parameters read back from their devices into `out`, a host MLP of the same shapes.
template <class Host, class T>
void read_back_into(Host& out, device_mlp_of<T>& m, ddp::memory_domain& dev, ddp::memory_domain& last) {
  pair_up(out, m, dev, last, [](ddp::parameter<T>& to, device_param_of<T>& from, ddp::memory_domain& d) {
    d.copy(from.value_tensor(), ddp::raw_tensor::of(to.value()));
    d.synchronize();
  });
}
/// The values of `m`'s parameters read back from their devices into a host mlp.
inline mlp read_back(device_mlp& m, ddp::memory_domain& dev, ddp::memory_domain& last) {
  mlp out = make_mlp(1);
  read_back_into(out, m, dev, last);
  return out;
}

/// Which device runs layer `k` (0: fc1) of a model placed by device_model.
inline ddp::testing::fake_device& device_of_layer(int k, ddp::testing::fake_device& dev, ddp::testing::fake_device& last) {
  return k == 2 ? last : dev;
}

/// mlp.hpp's forward_backward on the devices: each layer's forward and backward a kernel on its device's stream
/// (activations cross devices in host memory, which kernels may touch), each layer's gradients reported from the
/// host right after its backward is enqueued. `scope(layer)` wraps the layer's use (dp.unshard under full_shard);
/// a kernel works on the parameter views as they are when it is enqueued.
template <class T, class Report, class Scope>
void device_forward_backward(device_mlp_of<T>& m, const batch& b, float scale, Report&& report, Scope&& scope,
                             ddp::testing::fake_device& dev, ddp::testing::fake_device& last) {
  const std::size_t n = b.n;
  auto x = std::make_shared<std::vector<float>>(b.x);
  auto a1 = std::make_shared<std::vector<float>>(), a2 = std::make_shared<std::vector<float>>();
  auto out = std::make_shared<std::vector<float>>(), delta = std::make_shared<std::vector<float>>();
  device_linear_of<T>* layers[] = {&m.fc1, &m.fc2, &m.fc3};
  const std::shared_ptr<std::vector<float>> inputs[] = {x, a1, a2};
  const std::shared_ptr<std::vector<float>> outputs[] = {a1, a2, out};
  for (int k = 0; k < 3; ++k) {
    [[maybe_unused]] auto g = scope(*layers[k]);
    const device_linear_of<T> l = *layers[k];  // the views as they are now
    device_of_layer(k, dev, last).run(l.ranges(), [l, in = inputs[k], to = outputs[k], n, k] {
      *to = detail::layer_forward(l, *in, n, k < 2);
    });
    device_of_layer(k, dev, last).synchronize();  // the next device reads the activation
  }
  last.run({}, [out, delta, y = b.y, scale] {
    delta->resize(out->size());
    for (std::size_t i = 0; i < out->size(); ++i) (*delta)[i] = scale * ((*out)[i] - y[i]);
  });
  last.synchronize();
  for (int k = 2; k >= 0; --k) {
    [[maybe_unused]] auto g = scope(*layers[k]);
    const device_linear_of<T> l = *layers[k];
    const auto in = inputs[k];
    const auto act = k > 0 ? inputs[k] : nullptr;
    device_of_layer(k, dev, last).run(l.ranges(), [l, in, delta, act, n]() mutable {
      auto back = detail::layer_backward(l, *in, *delta, n, false);
      if (act)
        for (std::size_t i = 0; i < back.size(); ++i) back[i] *= 1.0F - (*act)[i] * (*act)[i];  // tanh'
      *delta = std::move(back);
    });
    report(layers[k]->bias);
    report(layers[k]->weight);
    device_of_layer(k, dev, last).synchronize();  // the next layer's backward, maybe on the other device, reads delta
  }
}

}  // namespace ddp_test
