// A stand-in PrivateUse1 backend for treetrain's tests: what TorchNeuron is to PyTorch, on host
// memory. Loading this library registers a device type named STANDIN_NAME ("neuron" unless
// built otherwise) with STANDIN_DEVICES devices, through the same extension point TorchNeuron
// uses: register_privateuse1_backend, an allocator, a device guard, the hooks interface, the
// kernels a device must own (allocation, views, copies), one fast kernel (mm) and a boxed CPU
// fallback for everything else. It counts what it ran natively and through the fallback and the
// bytes it allocated (`standin_*` below), so tests can see work really reached the device.
//
// Built with -DSTANDIN_NO_FALLBACK it has no fallback: every op but the few kernels below then
// fails, which is how tests see the error for an op a backend lacks. Built with
// -DSTANDIN_NO_VIEW it lacks the `view` kernel alone (an early backend's gap): `view` then goes
// through the CPU fallback, which is what treetrain's device self-check must catch. Not part of the shipped
// library: tests/common builds it (scripts/build-standin.sh does the same by hand).

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#ifndef STANDIN_NAME
#define STANDIN_NAME "neuron"
#endif
#ifndef STANDIN_DEVICES
#define STANDIN_DEVICES 2
#endif

namespace {

std::atomic<int64_t> native_ops{0};
std::atomic<int64_t> fallback_ops{0};
std::atomic<int64_t> allocated_bytes{0};
std::mutex names_mutex;
std::map<std::string, int64_t> fallback_names;
thread_local c10::DeviceIndex current_device = 0;

const c10::DispatchKeySet kDeviceKeys(c10::DispatchKey::PrivateUse1);

// ---- memory ---------------------------------------------------------------------------------

void release(void* ptr) { std::free(ptr); }

struct HostBackedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    allocated_bytes += static_cast<int64_t>(n);
    void* data = n == 0 ? nullptr : std::malloc(n);
    TORCH_CHECK(n == 0 || data != nullptr, "stand-in device: out of memory allocating ", n, " bytes");
    return {data, data, &release, c10::Device(c10::DeviceType::PrivateUse1, current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HostBackedAllocator allocator;

// ---- device guard and hooks -----------------------------------------------------------------

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {c10::DeviceType::PrivateUse1, current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() >= 0 && d.index() < STANDIN_DEVICES, "stand-in device: no device ", int(d.index()),
                " (it has ", STANDIN_DEVICES, ")");
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return STANDIN_DEVICES; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return STANDIN_DEVICES; }
  c10::Device getDeviceFromPtr(void*) const override { return {c10::DeviceType::PrivateUse1, current_device}; }
  void init() const override {}
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), bytes);
  }
};

// ---- the kernels a device must own ----------------------------------------------------------

// A CPU tensor over the same host memory as the device tensor `t` (same sizes and strides).
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().is_cpu()) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>,
                               std::optional<c10::MemoryFormat> memory_format) {
  ++native_ops;
  return at::detail::empty_generic(size, &allocator, kDeviceKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>) {
  ++native_ops;
  return at::detail::empty_strided_generic(size, stride, &allocator, kDeviceKeys, c10::dtype_or_default(dtype));
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat>) {
  ++native_ops;
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, std::nullopt);
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  ++native_ops;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  ++native_ops;
  auto out = at::empty({a.size(0), b.size(1)}, a.options());
  auto host_out = host_alias(out);
  at::mm_out(host_out, host_alias(a), host_alias(b));
  return out;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ++fallback_ops;
  {
    std::lock_guard<std::mutex> lock(names_mutex);
    ++fallback_names[c10::toString(op.schema().operator_name())];
  }
  at::native::cpu_fallback(op, stack);
}

struct Registration {
  Registration() {
    c10::register_privateuse1_backend(STANDIN_NAME);
    c10::SetAllocator(c10::DeviceType::PrivateUse1, &allocator);
    static Hooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
};

Registration registration;

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
#ifndef STANDIN_NO_VIEW
  m.impl("view", at::native::view);
#endif
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("resize_", resize);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("mm", mm);
}

#ifndef STANDIN_NO_FALLBACK
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }
#endif

extern "C" {
int64_t standin_native_ops() { return native_ops; }
int64_t standin_fallback_ops() { return fallback_ops; }
int64_t standin_allocated_bytes() { return allocated_bytes; }
// "name=count" lines of the ops that went through the fallback, into `buf`.
void standin_fallback_report(char* buf, size_t len) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(names_mutex);
    for (const auto& [name, count] : fallback_names) text += name + "=" + std::to_string(count) + "\n";
  }
  size_t n = len == 0 ? 0 : std::min(len - 1, text.size());
  std::memcpy(buf, text.data(), n);
  if (len) buf[n] = '\0';
}
}
