// treetrain's bridge to PyTorch's PrivateUse1 extension point, the device slot TorchNeuron
// (`neuron`) and other out-of-tree backends register themselves in. tch 0.24 has no name for
// that device (it shows such tensors as MPS), so loading a backend library, asking libtorch
// what it registered, and moving tensors there all go through here. Rust holds tensors as
// tch's `at::Tensor*`; every entry point returns C++ exceptions as text (see guarded.hpp).

#include <ATen/ATen.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/DeviceType.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/variable.h>

#include <dlfcn.h>

#include <string>

#include "../shim/guarded.hpp"

using treetrain_shim::guarded;
using treetrain_shim::set_error;

namespace {

c10::Device privateuse1(int index) {
  return c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index));
}

}  // namespace

extern "C" {

// dlopen(path) with its symbols global, as `import torch_neuronx` loads its library: the
// library's static initialisers register the backend. Loading a library twice is a no-op.
int tt_pu1_load(const char* path, char* err, size_t len) {
  if (dlopen(path, RTLD_NOW | RTLD_GLOBAL) != nullptr) return 0;
  const char* why = dlerror();
  set_error(err, len, why == nullptr ? "dlopen failed" : why);
  return 1;
}

// Whether a PrivateUse1 backend is present: it registered its name, or at least the device guard
// every backend that holds tensors needs (some register the name later, from Python, as
// `torch.utils.rename_privateuse1_backend`; libtorch then calls it "privateuseone").
int tt_pu1_registered() {
  return c10::is_privateuse1_backend_registered() || c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)
             ? 1
             : 0;
}

// The registered name (lower case), e.g. "neuron"; "privateuseone" when none is.
int tt_pu1_name(char* buf, size_t len, char* err, size_t errlen) {
  return guarded(err, errlen, [&] { set_error(buf, len, c10::get_privateuse1_backend(true)); });
}

// How many devices the backend has: its hooks' count when they report one, else its device
// guard's (every backend that can hold a tensor registers a guard).
int tt_pu1_device_count(int* out, char* err, size_t len) {
  return guarded(err, len, [&] {
    int count = 0;
    if (at::isPrivateUse1HooksRegistered()) {
      count = at::detail::getPrivateUse1Hooks().deviceCount();
    }
    if (count <= 0 && c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)) {
      count = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->deviceCount();
    }
    *out = count;
  });
}

// The file of the library that registered the backend: the one holding the vtable of its device
// guard (every backend registers one), as the dynamic loader maps it. Empty when unknown.
int tt_pu1_library(char* buf, size_t len, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    std::string file;
    if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)) {
      const void* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
      const void* vtable = *static_cast<const void* const*>(guard);
      Dl_info info;
      if (dladdr(vtable, &info) != 0 && info.dli_fname != nullptr) file = info.dli_fname;
    }
    set_error(buf, len, file);
  });
}

// `t` on PrivateUse1 device `index` (a new handle; `t` itself when it is there already, as
// `Tensor::to` does).
int tt_pu1_to(const at::Tensor* t, int index, at::Tensor** out, char* err, size_t len) {
  return guarded(err, len, [&] { *out = new at::Tensor(t->to(privateuse1(index))); });
}

// Moves a parameter's data to PrivateUse1 device `index` in place: every handle sharing the
// tensor (the var store's, the layers') sees the moved data. What `set_data` does, without its
// check that both sides are CPU/CUDA-like dense tensors, which PrivateUse1 tensors are not
// (TensorImpl's list of dense backends). Refused once autograd has built a gradient
// accumulator for it: moving is done at load time, before any backward pass.
int tt_pu1_move_into(at::Tensor* var, int index, char* err, size_t len) {
  return guarded(err, len, [&] {
    TORCH_CHECK(!torch::autograd::impl::try_get_grad_accumulator(*var),
                "a parameter that took part in a backward pass cannot be moved; place the model before training");
    at::Tensor moved;
    {
      c10::NoGradGuard no_grad;
      moved = var->detach().to(privateuse1(index));
    }
    if (var->grad().defined()) var->mutable_grad() = at::Tensor();
    var->unsafeGetTensorImpl()->shallow_copy_from(moved.getIntrusivePtr());
  });
}

// The PrivateUse1 device index of `t`, or -1 when `t` lives elsewhere (tch names those itself).
int tt_pu1_index_of(const at::Tensor* t) {
  c10::Device d = t->device();
  if (d.type() != c10::DeviceType::PrivateUse1) return -1;
  return d.has_index() ? d.index() : 0;
}

}  // extern "C"
