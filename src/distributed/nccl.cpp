// treetrain's NCCL process group: a shared library of its own (libtreetrain_nccl.so), compiled
// by build.rs against the torch wheel's c10d headers and the nccl.h torch 2.11.0 pins (2.28.9,
// from the nvidia-nccl-cu13 wheel: ProcessGroupNCCL::Options embeds ncclConfig_t, so the header
// must be that version's). Nothing here links CUDA or NCCL: the library is loaded at run time
// into a process running CUDA libtorch (TREETRAIN_TORCH_CUDA), whose libtorch_cuda.so exports
// ProcessGroupNCCL and loads libnccl.so.2. The process group it makes is handed to the c10d
// shim as a plain c10d::Backend, which runs every collective the same way as Gloo's, on the
// tensors' own device.

#define USE_C10D_NCCL 1
#include <nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "../shim/guarded.hpp"

#include <chrono>
#include <stdexcept>
#include <string>

using treetrain_shim::guarded;

extern "C" {

// NCCL_VERSION_CODE of the nccl.h this library was compiled with, and the version the loaded
// libnccl.so.2 reports (ncclGetVersion): a mismatch means ncclConfig_t may differ.
int tt_nccl_versions(int* header, int* runtime, char* err, size_t len) {
  return guarded(err, len, [&] {
    *header = NCCL_VERSION_CODE;
    int version = 0;
    ncclResult_t r = ncclGetVersion(&version);
    if (r != ncclSuccess) {
      throw std::runtime_error(std::string("ncclGetVersion failed: ") + ncclGetErrorString(r));
    }
    *runtime = version;
  });
}

// A ProcessGroupNCCL of `size` ranks over `store` (a c10d::Store* the caller keeps; one more
// reference is taken), keys under `prefix`, bound to CUDA device `device`. Returns an owning
// c10d::Backend* for tt_group_adopt (the c10d shim), or null with the reason in `err`.
void* tt_nccl_group(void* store, const char* prefix, int rank, int size, int device, double timeout_s,
                    char* err, size_t len) {
  void* out = nullptr;
  guarded(err, len, [&] {
    auto base = c10::intrusive_ptr<c10d::Store>::reclaim_copy(static_cast<c10d::Store*>(store));
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base);
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, opts);
    pg->setBoundDeviceId(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
    c10d::Backend* backend = pg.release();
    out = backend;
  });
  return out;
}

}  // extern "C"
