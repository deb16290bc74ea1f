// The small ops of a decode step on the CPU, each one pass over its data instead of the 5-15
// libtorch ops (and their dispatch, allocations and thread hand-offs) it replaces. At decode
// shapes (a few rows) those ops cost more than their arithmetic: a layer's attention over a
// static cache is mostly dispatch and allocation in libtorch's SDPA (`cargo bench --bench
// generation -- --split` times the attention, benches/README.md).
//
// Compiled without floating-point contraction, so a multiply and an add round as libtorch's
// separate kernels round them (RoPE is bit-exact; reductions differ only in summation order).
// Every array is contiguous f32 unless a stride is passed. Threads: libtorch's intra-op pool.
//
// Compiled for AVX2 + FMA (the caller checks the CPU has them: cpu_kernels::kernel_isa), with
// exp from the SLEEF build libtorch itself uses for its vectorised exp and silu.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// libtorch_cpu's SLEEF (exported; the same function its AVX2 exp kernels call).
extern "C" __m256 Sleef_expf8_u10avx2(__m256);

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

// Sum of a[i] * b[i] in 8 lanes (then across them).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 part = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) part = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), part);
  alignas(32) float l[8];
  _mm256_store_ps(l, part);
  float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The lane sums of 8 vectors, as one vector (sum i in lane i): one transpose-and-add tree
// instead of 8 horizontal sums.
inline __m256 lane_sums8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Requests one cache row of `d` floats into L1 (one prefetch per 64-byte line).
inline void prefetch_row(const float* row, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i, 0, 3);
}

// How many keys ahead of the one being scored the first head of a group requests. A step's
// cache was last read a whole step (every weight) ago, so it comes from memory and is requested
// well ahead: two blocks of eight keys.
constexpr int64_t kPrefetchKeys = 16;

// scores[j] = dot(q, k row slots[j]) * scale for j < n, eight keys at a time. With
// `prefetch_v` (the first query head of a group), it also requests the keys kPrefetchKeys
// ahead and the value rows of the block it scores, which the weighted sum reads right after.
// The eight key rows' addresses are taken once per block (indexed inside the column loop,
// the slots would be reloaded and multiplied for every vector of columns).
inline void scores_of(const float* q, const float* k, const int64_t* slots, int64_t n, int64_t d, float scale,
                      float* scores, const float* prefetch_v) {
  int64_t j = 0;
  if (d % 8 == 0) {
    for (; j + 8 <= n; j += 8) {
      if (prefetch_v != nullptr) {
        for (int c = 0; c < 8; ++c) {
          if (j + kPrefetchKeys + c < n) prefetch_row(k + slots[j + kPrefetchKeys + c] * d, d);
          prefetch_row(prefetch_v + slots[j + c] * d, d);
        }
      }
      const float* key[8];
      for (int c = 0; c < 8; ++c) key[c] = k + slots[j + c] * d;
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[c] + i), acc[c]);
      }
      _mm256_storeu_ps(scores + j, _mm256_mul_ps(lane_sums8(acc), _mm256_set1_ps(scale)));
    }
  }
  for (; j < n; ++j) scores[j] = dot(q, k + slots[j] * d, d) * scale;
}

// o[0, 8 W) = sum over j < n of p[j] * (v row slots[j])[i0, i0 + 8 W): W vectors of columns
// held in registers across all the slots. W is a compile-time count so that the accumulators
// stay in registers: with a run-time count GCC kept them on the stack (`perf annotate`: each
// multiply-add read its accumulator from the stack and stored it back).
template <int W>
inline void weighted_values(const float* p, const float* v, const int64_t* slots, int64_t n, int64_t d, int64_t i0,
                            float* o) {
  __m256 acc[W];
  for (int c = 0; c < W; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* value = v + slots[j] * d + i0;
    __m256 w = _mm256_set1_ps(p[j]);
    for (int c = 0; c < W; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + 8 * c), acc[c]);
  }
  for (int c = 0; c < W; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
}

// x[i] = exp(x[i]).
inline void exp_in_place(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = Sleef_expf8_u10avx2(_mm256_loadu_ps(x + i));
    _mm256_storeu_ps(x + i, e);
  }
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// y = weight * (x * 1 / sqrt(mean(x^2) + eps)) over one row of `dim` floats (y may be x).
void rms_norm_row(const float* x, int64_t dim, const float* weight, double eps, float* y) {
  float var = dot(x, x, dim) / static_cast<float>(dim);
  float inv = 1.f / std::sqrt(var + static_cast<float>(eps));
  for (int64_t i = 0; i < dim; ++i) {
    float normed = x[i] * inv;
    y[i] = weight[i] * normed;
  }
}

// x' = x * cos + rotate_half(x) * sin for one head of `d` floats (rotate_half(x) = [-x2, x1]).
void rope_head(float* x, int64_t d, const float* cos, const float* sin) {
  int64_t half = d / 2;
  float rotated[1024];
  for (int64_t i = 0; i < half; ++i) {
    rotated[i] = -x[half + i];
    rotated[half + i] = x[i];
  }
  for (int64_t i = 0; i < d; ++i) {
    float a = x[i] * cos[i];
    float b = rotated[i] * sin[i];
    x[i] = a + b;
  }
}

// out [group heads x d] for one (row, kv head): softmax(q k^T * scale) v over `slots` (the
// indices of the valid ones), queries at q + r * d.
void attend_group(const float* q, const float* k, const float* v, const std::vector<int64_t>& slots, int64_t group,
                  int64_t d, float scale, float* out, std::vector<float>& scores) {
  int64_t n = static_cast<int64_t>(slots.size());
  scores.resize(static_cast<size_t>(group * n));
  // 1. Scores of each query head of the group against the valid keys.
  for (int64_t r = 0; r < group; ++r)
    scores_of(q + r * d, k, slots.data(), n, d, scale, scores.data() + r * n, r == 0 ? v : nullptr);
  for (int64_t r = 0; r < group; ++r) {
    float* p = scores.data() + r * n;
    float* o = out + r * d;
    if (n == 0) {
      std::fill(o, o + d, 0.f);
      continue;
    }
    // 2. Softmax weights (shifted by the row's largest score).
    float top = *std::max_element(p, p + n);
    for (int64_t j = 0; j < n; ++j) p[j] -= top;
    exp_in_place(p, n);
    float total = 0.f;
    for (int64_t j = 0; j < n; ++j) total += p[j];
    // 3. The weighted sum of values, 64 columns at a time held in registers.
    if (d % 8 == 0) {
      int64_t i0 = 0;
      for (; i0 + 64 <= d; i0 += 64) weighted_values<8>(p, v, slots.data(), n, d, i0, o + i0);
      for (; i0 < d; i0 += 8) weighted_values<1>(p, v, slots.data(), n, d, i0, o + i0);
    } else {
      std::fill(o, o + d, 0.f);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < d; ++i) o[i] += p[j] * v[slots[j] * d + i];
    }
    float inv = 1.f / total;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

}  // namespace

extern "C" {

// y [rows, dim] = RMSNorm(x [rows, dim]) with `weight` [dim]. In place when y == x.
void tt_rms_norm(const float* x, int64_t rows, int64_t dim, const float* weight, double eps, float* y) {
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(x + r * dim, dim, weight, eps, y + r * dim);
  });
}

// In place on the fused q/k/v product `qkv` [rows, (heads + 2 kv_heads) * d]: each q head and
// each k head normed (when q_norm / k_norm [d] are given: Qwen3's per-head RMSNorm), then
// rotated by the row's `cos`, `sin` [rows, d]. v is left alone. Returns 1 (nothing written)
// for an odd d or d > 1024.
int tt_qk_norm_rope(float* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, const float* cos,
                    const float* sin, const float* q_norm, const float* k_norm, double eps) {
  if (d > 1024 || d % 2 != 0) return 1;
  int64_t width = (heads + 2 * kv_heads) * d;
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = qkv + r * width;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = row + h * d;
        const float* norm = h < heads ? q_norm : k_norm;
        if (norm != nullptr) rms_norm_row(x, d, norm, eps, x);
        rope_head(x, d, cos + r * d, sin + r * d);
      }
    }
  });
  return 0;
}

// One query per row attending over a KV cache, grouped-query: out [batch, heads * d] (row b,
// head h at h * d: the layout o_proj reads) = softmax(q k^T * scale) v over the slots where
// `valid` [batch, slots] is true, for the query of row b, head h at q + b * q_row + h * d and
// k, v [batch, kv_heads, slots, d]. Query head h reads kv head h / (heads / kv_heads), as SDPA's
// enable_gqa does. A row with no valid slot gets zeros (SDPA would give NaN).
void tt_decode_attention(const float* q, int64_t q_row, const float* k, const float* v, const bool* valid,
                         int64_t batch, int64_t heads, int64_t kv_heads, int64_t slots, int64_t d, double scale,
                         float* out) {
  int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores;
    std::vector<int64_t> kept;
    int64_t kept_row = -1;
    for (int64_t p = p0; p < p1; ++p) {
      int64_t b = p / kv_heads, g = p % kv_heads;
      if (b != kept_row) {
        kept.clear();
        for (int64_t s = 0; s < slots; ++s)
          if (valid[b * slots + s]) kept.push_back(s);
        kept_row = b;
      }
      int64_t head = (b * kv_heads + g) * slots * d;
      attend_group(q + b * q_row + g * group * d, k + head, v + head, kept, group, d, static_cast<float>(scale),
                   out + b * heads * d + g * group * d, scores);
    }
  });
}

// y [rows, inter] = silu(gate) * up for gate_up [rows, 2 * inter] (gate first, as the fused
// gate/up product lays them out); silu(x) = x / (1 + exp(-x)).
void tt_swiglu(const float* gate_up, int64_t rows, int64_t inter, float* y) {
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = gate_up + r * 2 * inter;
      const float* up = gate + inter;
      float* out = y + r * inter;
      for (int64_t i = 0; i < inter; ++i) out[i] = -gate[i];
      exp_in_place(out, inter);
      for (int64_t i = 0; i < inter; ++i) {
        float silu = gate[i] / (1.f + out[i]);
        out[i] = silu * up[i];
      }
    }
  });
}

}  // extern "C"

#pragma GCC pop_options
