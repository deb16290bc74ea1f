// The CUDA caching allocator's own statistics (what torch.cuda.max_memory_allocated reads),
// reached from Rust: tch has no binding for them. Allocated bytes are what tensors hold, weights
// included; reserved bytes add the allocator's cached blocks. Neither counts the CUDA context nor
// cuDNN's or cuBLAS's workspaces outside the allocator, which cudaMemGetInfo differences do.
//
// Built as a shared library of its own (libtreetrain_cuda_memory.so) like the CUDA-graph one,
// loaded only into a process already running CUDA libtorch. Entry points return C++ exceptions
// as text (see guarded.hpp).

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>

#include "../shim/guarded.hpp"

using treetrain_shim::guarded;

extern "C" {

// out[0..4]: allocated bytes now and at peak, reserved bytes now and at peak, on `device`.
int tt_cuda_memory_stats(int device, int64_t* out, char* err, size_t len) {
  return guarded(err, len, [&] {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    out[3] = stats.reserved_bytes[all].peak;
  });
}

// Peaks start again from what is held now.
int tt_cuda_memory_reset_peak(int device, char* err, size_t len) {
  return guarded(err, len, [&] {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  });
}

}  // extern "C"
