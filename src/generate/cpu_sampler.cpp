// The sampler of a decode step on the CPU: every row's next token and its two log-probabilities
// from f32 logits, with the host sampler's rules (generate/sampling.rs: temperature, repetition
// penalty, top-k, then top-p, then min-p, renormalised, one uniform per row drawn by inverse CDF
// in vocabulary order) in f64, in one or two passes over the vocabulary per row.
//
// The tensor-op sampler (device_sampling.rs) makes f64 copies, four exp passes and a full
// sort for top-p over the whole vocabulary, which costs more than the step; here the
// exponentials are taken once (SLEEF's f64 exp, as libtorch uses, 1 ulp) and top-k / top-p sort
// only the head of the distribution (nth_element, widened until it holds the nucleus). Compiled
// for AVX2 + FMA; the caller checks the CPU has them.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

extern "C" __m256d Sleef_expd4_u10avx2(__m256d);

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Rules {
  bool sample;
  double temperature;
  int64_t top_k;  // 0: off
  double top_p;   // >= 1: off
  double min_p;   // <= 0: off
  double penalty;
  int64_t allowed;  // ids at or above are never chosen (padding rows of the LM head)
};

struct Chosen {
  int64_t token;
  double logprob;
  double untruncated;
};

// e[i] = exp(x[i] - shift); returns the sum.
double exp_shifted(const double* x, int64_t n, double shift, double* e) {
  __m256d total = _mm256_setzero_pd();
  __m256d s = _mm256_set1_pd(shift);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m256d v = Sleef_expd4_u10avx2(_mm256_sub_pd(_mm256_loadu_pd(x + i), s));
    _mm256_storeu_pd(e + i, v);
    total = _mm256_add_pd(total, v);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, total);
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) {
    e[i] = std::exp(x[i] - shift);
    sum += e[i];
  }
  return sum;
}

// The first index of the largest value (the host sampler's argmax): the maximum in 4 lanes,
// then its first position.
int64_t first_max(const double* x, int64_t n) {
  __m256d best = _mm256_set1_pd(kNegInf);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) best = _mm256_max_pd(best, _mm256_loadu_pd(x + i));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, best);
  double top = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  for (; i < n; ++i) top = std::max(top, x[i]);
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == top) return j;
  return 0;
}

// raw[i] = logits[i] / temperature in f64.
void scaled(const float* logits, int64_t n, double temperature, double* raw) {
  __m256d t = _mm256_set1_pd(temperature);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) _mm256_storeu_pd(raw + i, _mm256_div_pd(_mm256_cvtps_pd(_mm_loadu_ps(logits + i)), t));
  for (; i < n; ++i) raw[i] = static_cast<double>(logits[i]) / temperature;
}

// The kept tokens of top-k then top-p over `lp` (log-probabilities), most likely first: the
// head of the order is found with nth_element and widened until it decides both rules.
std::vector<int64_t> nucleus(const double* lp, int64_t vocab, const Rules& r) {
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  auto more_likely = [lp](int64_t a, int64_t b) { return lp[a] > lp[b]; };
  int64_t head = std::min<int64_t>(vocab, std::max<int64_t>(r.top_k > 0 ? r.top_k : 0, 256));
  while (true) {
    std::nth_element(order.begin(), order.begin() + (head - 1), order.end(), more_likely);
    std::sort(order.begin(), order.begin() + head, more_likely);
    std::vector<int64_t> kept;
    double cumulative = 0.0;
    bool decided = false;
    for (int64_t rank = 0; rank < head; ++rank) {
      if (r.top_k > 0 && rank >= r.top_k) {
        decided = true;
        break;
      }
      if (r.top_p < 1.0 && rank > 0 && cumulative >= r.top_p) {
        decided = true;
        break;
      }
      kept.push_back(order[rank]);
      cumulative += std::exp(lp[order[rank]]);
    }
    if (decided || head == vocab) return kept;
    head = std::min<int64_t>(vocab, head * 4);
  }
}

// One row: the host sampler's `choose`.
Chosen choose_row(const float* logits, int64_t vocab, const bool* seen, const Rules& r, double u,
                  std::vector<double>& raw, std::vector<double>& e) {
  raw.resize(static_cast<size_t>(vocab));
  e.resize(static_cast<size_t>(vocab));
  double temperature = r.sample ? std::max(r.temperature, 1e-6) : 1.0;
  scaled(logits, vocab, temperature, raw.data());
  // 1. The untruncated distribution: log_softmax(raw).
  int64_t argmax = first_max(raw.data(), vocab);
  double top = raw[argmax];
  double sum = exp_shifted(raw.data(), vocab, top, e.data());
  double lse = top + std::log(sum);
  // 2. The repetition penalty on the tokens seen (transformers' rule), into `raw` (now the
  //    scores; the untruncated log-prob of a token is recomputed from its logit).
  bool penalised = seen != nullptr && r.penalty != 1.0;
  auto untruncated = [&](int64_t t) { return static_cast<double>(logits[t]) / temperature - lse; };
  if (penalised) {
    for (int64_t i = 0; i < vocab; ++i)
      if (seen[i]) raw[i] = raw[i] > 0.0 ? raw[i] / r.penalty : raw[i] * r.penalty;
  }
  // Ids past the tokenizer's vocabulary score -inf: never drawn, never the argmax.
  for (int64_t i = r.allowed; i < vocab; ++i) raw[i] = kNegInf;
  bool rescored = penalised || r.allowed < vocab;
  if (!r.sample) {
    int64_t t = rescored ? first_max(raw.data(), vocab) : argmax;
    return {t, untruncated(t), untruncated(t)};
  }
  // 3. lp = log_softmax(scores); e holds exp(scores - top2), summing to `mass`.
  double top2 = rescored ? raw[first_max(raw.data(), vocab)] : top;
  double mass = rescored ? exp_shifted(raw.data(), vocab, top2, e.data()) : sum;
  double lse2 = top2 + std::log(mass);
  // 4. The kept set (vocabulary order), then the draw over it renormalised.
  std::vector<int64_t> kept;
  bool truncated = (r.top_k > 0) || (r.top_p < 1.0);
  if (truncated) {
    for (int64_t i = 0; i < vocab; ++i) raw[i] -= lse2;  // raw is lp from here
    kept = nucleus(raw.data(), vocab, r);
    std::sort(kept.begin(), kept.end());
  }
  double floor = kNegInf;
  if (r.min_p > 0.0) floor = (top2 - lse2) + std::log(r.min_p);
  auto lp_of = [&](int64_t i) { return truncated ? raw[i] : raw[i] - lse2; };
  auto keeps = [&](int64_t i) { return i < r.allowed && lp_of(i) >= floor; };
  double kept_mass = 0.0;
  int64_t last = -1;
  auto visit = [&](auto&& f) {
    if (truncated) {
      for (int64_t i : kept)
        if (keeps(i)) f(i);
    } else {
      for (int64_t i = 0; i < r.allowed; ++i)
        if (floor == kNegInf || keeps(i)) f(i);
    }
  };
  visit([&](int64_t i) {
    kept_mass += e[i];
    last = i;
  });
  if (last < 0) return {0, kNegInf, untruncated(0)};
  // renorm(i) = lp(i) - log(sum of kept p) = log(e[i] / kept_mass).
  double acc = 0.0;
  int64_t token = -1;
  visit([&](int64_t i) {
    if (token >= 0) return;
    acc += e[i] / kept_mass;
    if (u < acc) token = i;
  });
  if (token < 0) token = last;
  double renorm = lp_of(token) - std::log(kept_mass / mass);
  return {token, renorm, untruncated(token)};
}

}  // namespace

extern "C" {

// For each row of logits [rows, vocab] (contiguous f32), the host sampler's choice: tokens[r],
// logprob[r] (under the distribution sampled from) and untruncated[r] (under softmax(logits /
// T)). `seen` [rows, vocab] bool or null; ids from `allowed` on are never chosen; `uniforms`
// one per row (ignored when greedy).
void tt_choose_rows(const float* logits, int64_t rows, int64_t vocab, const bool* seen, int sample,
                    double temperature, int64_t top_k, double top_p, double min_p, double penalty,
                    int64_t allowed, const double* uniforms, int64_t* tokens, double* logprob, double* untruncated) {
  Rules rules{sample != 0, temperature, top_k, top_p, min_p, penalty, allowed};
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> raw, e;
    for (int64_t r = r0; r < r1; ++r) {
      const bool* row_seen = seen == nullptr ? nullptr : seen + r * vocab;
      Chosen c = choose_row(logits + r * vocab, vocab, row_seen, rules, uniforms[r], raw, e);
      tokens[r] = c.token;
      logprob[r] = c.logprob;
      untruncated[r] = c.untruncated;
    }
  });
}

}  // extern "C"

#pragma GCC pop_options
