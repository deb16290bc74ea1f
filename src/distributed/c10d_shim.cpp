// treetrain's bridge to PyTorch's own c10d (the engine torchrun users already run): stores,
// ProcessGroupGloo (or a ProcessGroupNCCL made by libtreetrain_nccl.so, nccl.cpp, and adopted
// here), and the few collectives data parallelism needs. Rust holds tensors as tch's
// `at::Tensor*`; every entry point catches C++ exceptions and returns them as text, so a failed
// collective (peer gone, timeout, port in use) becomes a typed Rust error, never an abort.
//
// Built by build.rs against the libtorch headers torch-sys uses. Gloo's headers are not in the
// torch wheel; setup-libtorch.sh unpacks Debian's libgloo-dev for them. Without them this file
// still compiles and every call says how to get them.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <ATen/ATen.h>

#include "../shim/guarded.hpp"

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using treetrain_shim::guarded;

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

}  // namespace

struct tt_store {
  c10::intrusive_ptr<c10d::Store> store;
};

// A process group: Gloo's or NCCL's, as the c10d::Backend both are. `device` is where its
// collectives run: the host for Gloo, the bound GPU for NCCL.
struct tt_group {
  c10::intrusive_ptr<c10d::Backend> pg;
  std::chrono::milliseconds timeout;
  int rank;
  int size;
  at::Device device;
};

// A flat collective in flight: its work and the tensors it reads and writes (kept alive until
// it is waited for), and where a staged result is copied back.
struct tt_work {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor in;
  at::Tensor out;
  at::Tensor output;
  std::chrono::milliseconds timeout;
  // A gradient bucket's gradients, given their part of `output` once it is done.
  std::vector<at::Tensor> grads;
};

namespace {

// Waits for `w`, copies a staged result back and frees it (also when the wait fails).
void finish(tt_work* w) {
  std::unique_ptr<tt_work> owned(w);
  if (!w->work->wait(w->timeout)) {
    throw std::runtime_error("collective did not finish within the timeout");
  }
  if (!w->out.is_same(w->output)) w->output.copy_(w->out);
  int64_t offset = 0;
  for (auto& gr : w->grads) {
    gr.copy_(w->output.narrow(0, offset, gr.numel()).view_as(gr));
    offset += gr.numel();
  }
}

void wait(tt_group* g, const c10::intrusive_ptr<c10d::Work>& work) {
  if (!work->wait(g->timeout)) {
    throw std::runtime_error("collective did not finish within the timeout");
  }
}

// A tensor where the group's collectives run: itself, or a copy (Gloo reads host memory only,
// NCCL device memory only). `staged` reports a tensor off the host copied to it for Gloo.
at::Tensor on_group_device(tt_group* g, const at::Tensor& t, bool* staged) {
  if (t.device() == g->device) return t.contiguous();
  if (g->device.is_cpu()) *staged = true;
  return t.to(g->device).contiguous();
}

void allreduce_flat(tt_group* g, at::Tensor& flat, bool average, bool* staged) {
  at::Tensor work = on_group_device(g, flat, staged);
  std::vector<at::Tensor> ts{work};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = g->timeout;
  wait(g, g->pg->allreduce(ts, opts));
  if (average) work.div_(g->size);
  if (!work.is_same(flat)) flat.copy_(work);
}

// Starts `start(out, in)`, a collective from the flat `input` into the flat `output`, on the
// group's device (copies there, and back when waited for, where needed) and hands the work in
// flight back in `pending` for `tt_work_wait`.
template <typename Start>
void flat_collective(tt_group* g, at::Tensor& input, at::Tensor& output, int* staged, tt_work** pending,
                     Start start) {
  bool moved = false;
  at::Tensor in = on_group_device(g, input, &moved);
  at::Tensor out = on_group_device(g, output, &moved);
  *pending = new tt_work{start(out, in), in, out, output, g->timeout};
  *staged = moved ? 1 : 0;
}

void require_gloo() {
#ifndef USE_C10D_GLOO
  throw std::runtime_error(
      "treetrain was built without Gloo's headers, so it cannot create a process group: run "
      "scripts/setup-libtorch.sh (it unpacks Debian's libgloo-dev into .deps/gloo) and rebuild");
#endif
}

}  // namespace

extern "C" {

// A TCPStore: the server (hosting the rendezvous) when `listen_fd >= 0` (a socket Rust bound,
// so the address is exactly the one asked for), else a client of `host:port`.
tt_store* tt_store_tcp(const char* host, int port, int listen_fd, int workers, double timeout_s,
                       char* err, size_t len) {
  tt_store* out = nullptr;
  guarded(err, len, [&] {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = listen_fd >= 0;
    if (listen_fd >= 0) opts.masterListenFd = listen_fd;
    if (workers > 0) opts.numWorkers = static_cast<size_t>(workers);
    // The server does not wait for clients here: ranks meet in the process group's rendezvous.
    opts.waitWorkers = false;
    opts.timeout = millis(timeout_s);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    out = new tt_store{store};
  });
  return out;
}

// A FileStore (for tests and shared file systems).
tt_store* tt_store_file(const char* path, int workers, double timeout_s, char* err, size_t len) {
  tt_store* out = nullptr;
  guarded(err, len, [&] {
    auto store = c10::make_intrusive<c10d::FileStore>(std::string(path), workers);
    store->setTimeout(millis(timeout_s));
    out = new tt_store{store};
  });
  return out;
}

void tt_store_free(tt_store* s) { delete s; }

// Adds `delta` to the counter `key` in the store; returns the new value (through `out`).
int tt_store_add(tt_store* s, const char* key, int64_t delta, int64_t* out, char* err, size_t len) {
  return guarded(err, len, [&] { *out = s->store->add(std::string(key), delta); });
}

// A Gloo process group over `store` (keys under `prefix`). Gloo's device is made for
// `interface` when given (GLOO_SOCKET_IFNAME), else for `hostname` (an address of this host),
// else for whatever this machine's hostname resolves to.
tt_group* tt_group_gloo(tt_store* s, const char* prefix, int rank, int size, const char* hostname,
                        const char* interface, double timeout_s, char* err, size_t len) {
  tt_group* out = nullptr;
  guarded(err, len, [&] {
    require_gloo();
#ifdef USE_C10D_GLOO
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), s->store);
    auto opts = c10d::ProcessGroupGloo::Options::create(millis(timeout_s));
    if (interface != nullptr && interface[0] != '\0') {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
    } else if (hostname != nullptr && hostname[0] != '\0') {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
    out = new tt_group{pg, millis(timeout_s), rank, size, at::Device(at::kCPU)};
#endif
  });
  return out;
}

// The store's c10d::Store (borrowed), for a library that makes its own process group.
void* tt_store_raw(tt_store* s) { return s->store.get(); }

// Takes over `backend`, an owning c10d::Backend* another treetrain library made (the NCCL
// one), as a group whose collectives run on CUDA device `cuda_device`.
tt_group* tt_group_adopt(void* backend, int rank, int size, int cuda_device, double timeout_s) {
  auto pg = c10::intrusive_ptr<c10d::Backend>::reclaim(static_cast<c10d::Backend*>(backend));
  at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(cuda_device));
  return new tt_group{pg, millis(timeout_s), rank, size, device};
}

void tt_group_free(tt_group* g) { delete g; }

// All-reduce (sum, or mean when `average`) of each tensor in place.
int tt_all_reduce(tt_group* g, at::Tensor** ts, size_t n, int average, int* staged, char* err,
                  size_t len) {
  return guarded(err, len, [&] {
    bool moved = false;
    for (size_t i = 0; i < n; ++i) allreduce_flat(g, *ts[i], average != 0, &moved);
    *staged = moved ? 1 : 0;
  });
}

// Broadcast of each tensor from `root`, in place.
int tt_broadcast(tt_group* g, at::Tensor** ts, size_t n, int root, int* staged, char* err, size_t len) {
  return guarded(err, len, [&] {
    bool moved = false;
    for (size_t i = 0; i < n; ++i) {
      at::Tensor& t = *ts[i];
      at::Tensor work = on_group_device(g, t, &moved);
      std::vector<at::Tensor> v{work};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      opts.timeout = g->timeout;
      wait(g, g->pg->broadcast(v, opts));
      if (!work.is_same(t)) t.copy_(work);
    }
    *staged = moved ? 1 : 0;
  });
}

// All-gather of one tensor per rank (the same shape and dtype everywhere) into `out`, shaped
// [size, *input.shape].
int tt_all_gather(tt_group* g, at::Tensor* input, at::Tensor* out, char* err, size_t len) {
  return guarded(err, len, [&] {
    bool moved = false;
    at::Tensor in = on_group_device(g, *input, &moved);
    std::vector<at::Tensor> inputs{in};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < g->size; ++r) outputs[0].push_back(at::empty_like(in));
    c10d::AllgatherOptions opts;
    opts.timeout = g->timeout;
    wait(g, g->pg->allgather(outputs, inputs, opts));
    out->copy_(at::stack(outputs[0]));
  });
}

// Reduce-scatter (sum) of the flat `input` [size * n] into this rank's `output` [n]: rank r
// gets the sum of every rank's elements r*n .. (r+1)*n (c10d's _reduce_scatter_base).
int tt_reduce_scatter(tt_group* g, at::Tensor* input, at::Tensor* output, int* staged, tt_work** pending,
                      char* err, size_t len) {
  return guarded(err, len, [&] {
    flat_collective(g, *input, *output, staged, pending, [&](at::Tensor& out, at::Tensor& in) {
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      opts.timeout = g->timeout;
      return g->pg->_reduce_scatter_base(out, in, opts);
    });
  });
}

// All-gather of every rank's flat `input` [n] into `output` [size * n], rank order
// (c10d's _allgather_base).
int tt_all_gather_flat(tt_group* g, at::Tensor* input, at::Tensor* output, int* staged, tt_work** pending,
                       char* err, size_t len) {
  return guarded(err, len, [&] {
    flat_collective(g, *input, *output, staged, pending, [&](at::Tensor& out, at::Tensor& in) {
      c10d::AllgatherOptions opts;
      opts.timeout = g->timeout;
      return g->pg->_allgather_base(out, in, opts);
    });
  });
}

// Starts summing the gradients of `params` (one dtype) over the ranks as one flat bucket; a
// parameter without a gradient takes part with zeros and gets one. The sum is copied into the
// gradients when `pending` is waited for; until then they must not change.
int tt_all_reduce_grads_start(tt_group* g, at::Tensor** params, size_t n, int* staged, tt_work** pending,
                              char* err, size_t len) {
  return guarded(err, len, [&] {
    std::vector<at::Tensor> grads, parts;
    for (size_t i = 0; i < n; ++i) {
      at::Tensor& p = *params[i];
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      grads.push_back(p.grad());
      parts.push_back(p.grad().reshape({-1}));
    }
    at::Tensor flat = at::cat(parts);
    bool moved = false;
    at::Tensor work = on_group_device(g, flat, &moved);
    std::vector<at::Tensor> ts{work};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = g->timeout;
    *pending = new tt_work{g->pg->allreduce(ts, opts), work, work, flat, g->timeout, std::move(grads)};
    *staged = moved ? 1 : 0;
  });
}

// Waits for a collective started with `pending` and frees it.
int tt_work_wait(tt_work* w, char* err, size_t len) {
  return guarded(err, len, [&] { finish(w); });
}

// Frees a collective never waited for (an error path), after it ends: its tensors must outlive
// it.
void tt_work_free(tt_work* w) {
  try {
    finish(w);
  } catch (...) {
  }
}

int tt_barrier(tt_group* g, char* err, size_t len) {
  return guarded(err, len, [&] {
    c10d::BarrierOptions opts;
    opts.timeout = g->timeout;
    wait(g, g->pg->barrier(opts));
  });
}

// Frees the gradient of `t` (undefined until the next backward creates it again): what a
// sharded optimizer does once the gradients are reduce-scattered.
void tt_free_grad(at::Tensor* t) { t->mutable_grad().reset(); }

// fsdp = "full_shard": a parameter's storage is freed between uses and refilled before the
// next, as FSDP does; the tensor (its sizes, views, autograd identity) stays, so the layers'
// handles and the graph's saved tensors see the refilled bytes.
int64_t tt_storage_nbytes(at::Tensor* t) { return static_cast<int64_t>(t->storage().nbytes()); }

// Which storage the tensor views (its address, for telling shared storages apart).
int64_t tt_storage_id(at::Tensor* t) {
  return reinterpret_cast<int64_t>(t->storage().unsafeGetStorageImpl());
}

// Gives the storage `nbytes` bytes: 0 frees them; otherwise, when it holds none, fresh ones from
// the device's allocator (contents undefined until written).
int tt_storage_resize(at::Tensor* t, int64_t nbytes, char* err, size_t len) {
  return guarded(err, len, [&] {
    c10::StorageImpl* impl = t->storage().unsafeGetStorageImpl();
    if (nbytes == 0) {
      impl->set_data_ptr_noswap(at::DataPtr(nullptr, t->device()));
      impl->set_nbytes(0);
      return;
    }
    if (impl->nbytes() == static_cast<size_t>(nbytes)) return;
    TORCH_CHECK(impl->nbytes() == 0, "a parameter's storage holds ", impl->nbytes(), " bytes, not 0 or ",
                nbytes);
    c10::Allocator* alloc = impl->allocator();
    if (alloc == nullptr) alloc = c10::GetAllocator(t->device().type());
    impl->set_data_ptr_noswap(alloc->allocate(static_cast<size_t>(nbytes)));
    impl->set_nbytes(static_cast<size_t>(nbytes));
  });
}

// `dst.data = src` in bytes: copies without bumping the version counter autograd checks, so a
// graph that saved `dst` before its storage was freed and refilled back-propagates.
int tt_copy_unversioned(at::Tensor* dst, at::Tensor* src, char* err, size_t len) {
  return guarded(err, len, [&] {
    at::NoGradGuard no_grad;
    dst->variable_data().copy_(*src);
  });
}

int tt_built_with_gloo() {
#ifdef USE_C10D_GLOO
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
