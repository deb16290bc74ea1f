// The product of a few input rows with a large weight matrix, y = x W^T (+ b), as a decode step
// computes it on the CPU: x [M, K] with M small (one row per sequence), W [N, K] in its
// state_dict layout. Such a product is bound by reading W once from memory (at a handful of
// rows; at 8 rows in f32 its multiply-adds can take as long: `cargo bench --bench generation --
// --split`, benches/README.md), and MKL's sgemm packs (copies) W on every call for it, so it
// reads W at a fraction of the machine's bandwidth. Here each thread streams its contiguous
// block of weight rows once, in tiles of a few rows against every input row held in registers,
// prefetching the next tile.
//
// One source, two instruction sets (AVX-512 and AVX2 + FMA, chosen at run time); other CPUs
// report "unsupported" and the caller keeps libtorch's product. Threads are libtorch's own
// intra-op threads (at::parallel_for), so the count follows tch::set_num_threads.

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
constexpr int kLanes = 16;
typedef __m512 Native;
inline float reduce_lanes(__m512 v) { return _mm512_reduce_add_ps(v); }
constexpr int kRows = 4;   // 4 x 8 accumulators fill the 32 vector registers' budget best
constexpr int kBatch = 8;  // (measured against 1-3 rows: fewer rows re-read x from L1 more)
#include "product.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
constexpr int kLanes = 8;
typedef __m256 Native;
inline float reduce_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int kRows = 3;   // 3 x 4 accumulators + 3 weights + 1 input = the 16 registers
constexpr int kBatch = 4;
#include "product.inc"
}  // namespace avx2
#pragma GCC pop_options

#endif

namespace {

using Product = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t);

Product best_product() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return avx512::product;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2::product;
#endif
  return nullptr;
}

}  // namespace

extern "C" {

// Whether autograd records operations on this thread (tch has no query for it).
int tt_grad_enabled() { return c10::GradMode::is_enabled() ? 1 : 0; }

// Which kernel runs here: 2 = AVX-512, 1 = AVX2 + FMA, 0 = none (use libtorch's product).
int tt_skinny_isa() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

// y [M, N] = x [M, K] . w [N, K]^T (+ bias [N]), every array contiguous f32. Returns 1 (and
// writes nothing) when this CPU has no kernel.
int tt_skinny_linear(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias,
                     float* y) {
  const Product product = best_product();
  if (product == nullptr) return 1;
  // A grain of rows that is at least a few tiles: small maps stay on one thread.
  int64_t grain = std::max<int64_t>(16, (1 << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    product(x, M, K, w, N, y, n0, n1);
    if (bias != nullptr) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
    }
  });
  return 0;
}

}  // extern "C"
