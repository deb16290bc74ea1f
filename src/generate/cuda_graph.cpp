// CUDA graphs for the decode step: libtorch's at::cuda::CUDAGraph, reached from Rust (tch has no
// binding for it). A capture runs on a side stream taken from libtorch's pool, with libtorch's
// caching allocator serving the graph's tensors from the graph's private pool; a replay
// launches the whole recorded step (tens of kernels a layer) as one graph on the current stream.
//
// Built as a shared library of its own (libtreetrain_cuda_graph.so), never linked into the
// binaries: its CUDA symbols resolve when it is loaded into a process that already runs a CUDA
// libtorch (libtorch_cuda.so, libc10_cuda.so, libcudart loaded), so CPU-only machines never need
// them. Every entry point returns C++ exceptions as text (see guarded.hpp).

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../shim/guarded.hpp"

using treetrain_shim::guarded;

namespace {

struct DecodeGraph {
  explicit DecodeGraph(c10::DeviceIndex device)
      : previous(c10::cuda::getCurrentCUDAStream(device)), capture(c10::cuda::getStreamFromPool(false, device)) {}

  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream previous;
  c10::cuda::CUDAStream capture;
};

DecodeGraph* as_graph(void* g) {
  if (g == nullptr) throw std::runtime_error("no CUDA graph");
  return static_cast<DecodeGraph*>(g);
}

}  // namespace

extern "C" {

// A new, empty graph for CUDA device `device`.
int tt_cuda_graph_new(int device, void** out, char* err, size_t len) {
  return guarded(err, len, [&] { *out = new DecodeGraph(static_cast<c10::DeviceIndex>(device)); });
}

// Starts recording: work queued so far on the current stream is finished first, then the side
// stream becomes current and capture begins (thread-local mode: other threads' CUDA calls are
// not disturbed). Every libtorch op on this thread is recorded, not run, until tt_cuda_graph_end.
int tt_cuda_graph_begin(void* g, char* err, size_t len) {
  return guarded(err, len, [&] {
    DecodeGraph* graph = as_graph(g);
    graph->previous = c10::cuda::getCurrentCUDAStream(graph->capture.device_index());
    graph->previous.synchronize();
    c10::cuda::setCurrentCUDAStream(graph->capture);
    try {
      graph->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    } catch (...) {
      c10::cuda::setCurrentCUDAStream(graph->previous);
      throw;
    }
  });
}

// Ends recording and instantiates the graph; the stream that was current before is current again
// (also when the capture failed).
int tt_cuda_graph_end(void* g, char* err, size_t len) {
  return guarded(err, len, [&] {
    DecodeGraph* graph = as_graph(g);
    struct Restore {
      DecodeGraph* graph;
      ~Restore() { c10::cuda::setCurrentCUDAStream(graph->previous); }
    } restore{graph};
    graph->graph.capture_end();
  });
}

// Launches the recorded step on the current stream.
int tt_cuda_graph_replay(void* g, char* err, size_t len) {
  return guarded(err, len, [&] { as_graph(g)->graph.replay(); });
}

void tt_cuda_graph_free(void* g) { delete static_cast<DecodeGraph*>(g); }

}  // extern "C"
