// Host tensors backed by transparent huge pages (2 MiB), for the parameters a decode step
// streams from memory. Where the kernel's THP mode is `madvise` (Debian's and Ubuntu's default)
// anonymous memory gets 4 KiB pages unless advised otherwise, and libtorch's allocator advises
// only when THP_MEM_ALLOC_ENABLE is set in the environment, which a library cannot decide for
// its process. A sequential read of 4 KiB pages misses the TLB every 4 KiB; under a hypervisor
// each miss walks two page tables. `cargo bench --bench generation -- --pages` times the
// difference.

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "../shim/guarded.hpp"

using treetrain_shim::guarded;

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

#if defined(__linux__)
// A private anonymous mapping of `bytes` (a multiple of the system's page size) whose start is
// kHugePage-aligned, advised MADV_HUGEPAGE before anything touches it: every whole 2 MiB of it
// can be a huge page, and a tail under 2 MiB stays in small pages rather than rounding the
// mapping up (a huge page is only placed where all of it lies inside the mapping). `advised`
// says whether the kernel took the advice (it refuses where it has no THP). nullptr when mmap
// fails.
void* map_huge(size_t bytes, bool* advised) {
  void* raw = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = round_up(start, kHugePage);
  // Give back the unaligned head and the tail, so one munmap of `bytes` frees the rest.
  if (aligned > start) munmap(raw, aligned - start);
  size_t tail = start + bytes + kHugePage - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  *advised = madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE) == 0;
  return reinterpret_cast<void*>(aligned);
}
#endif

}  // namespace

extern "C" {

// An uninitialised contiguous CPU tensor of `numel` elements of `like`'s dtype, in huge pages
// where the system has them (`*advised` = 1), else in libtorch's own allocation (0). The
// mapping is freed when the last tensor sharing its storage goes.
int tt_huge_page_empty(int64_t numel, const at::Tensor* like, at::Tensor** out, int* advised, char* err,
                       size_t len) {
  return guarded(err, len, [&] {
    auto options = at::TensorOptions().dtype(like->dtype()).device(at::kCPU);
    *advised = 0;
#if defined(__linux__)
    size_t bytes = round_up(static_cast<size_t>(numel) * like->element_size(), static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    bool took = false;
    if (numel > 0) {
      if (void* p = map_huge(bytes, &took)) {
        *advised = took ? 1 : 0;
        *out = new at::Tensor(at::from_blob(p, {numel}, [bytes](void* q) { munmap(q, bytes); }, options));
        return;
      }
    }
#endif
    *out = new at::Tensor(at::empty({numel}, options));
  });
}

}  // extern "C"
