//! Turning one row of logits into the next token, with the log-probabilities GRPO needs.

use crate::model::Truncation;
use crate::util::SplitMix64;

/// How the next token is chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// false: greedy (argmax); true: sample.
    pub do_sample: bool,
    /// Logits are divided by this before sampling (> 0).
    pub temperature: f64,
    /// Keep only the k most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches p (nucleus).
    pub top_p: Option<f64>,
    /// Keep tokens whose probability is at least `min_p` times the most likely one's.
    pub min_p: Option<f64>,
    /// > 1 discourages tokens already in the prompt or completion (CTRL-style); 1 = off.
    pub repetition_penalty: f64,
    /// Ids at or above this are never chosen: the tokenizer's vocabulary size, where the LM head
    /// has padding rows past it (Qwen3: 151,936 rows for 151,669 tokens) that would decode to
    /// nothing. Their probability still counts in the untruncated log-prob (the distribution a
    /// trainer recomputes), like any token truncation leaves out. `None`: every row.
    pub token_limit: Option<usize>,
    /// Seed of this call's random draws. Every row of a batch draws from its own stream, keyed
    /// by the seed and the row's number, so a row's tokens do not depend on the other rows.
    pub seed: u64,
    /// The number of this call's first row (its stream): a batch that is one share of a larger
    /// one (a rank's prompts in a multi-process run) draws what the whole batch would have.
    pub first_row: u64,
}

/// The smallest temperature taken (1e-5 in messages): vLLM's floor for sampling. Far below it `logits /
/// temperature` passes fp32's range (inf, then NaN log-probs).
pub(crate) const MIN_TEMPERATURE: f64 = 1e-5;

impl SamplingConfig {
    /// The first setting out of its range, as `(field, what is wrong)`: temperature finite and
    /// at least 1e-5 (vLLM's floor), top_p in (0, 1], min_p in [0, 1], repetition_penalty finite and positive
    /// (transformers' ranges). Checked before any generation (CLI, generator, GRPO config).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let bad = |field, v: f64, range: &str| Err((field, format!("is {v}; must be {range}")));
        if !(self.temperature.is_finite() && self.temperature >= MIN_TEMPERATURE) {
            return Err((
                "temperature",
                format!(
                    "is {:e}; must be finite and at least 1e-5 (below it sampling is greedy in all but name and the scaled logits overflow to NaN); write temperature = 0.01 for near-greedy sampling",
                    self.temperature
                ),
            ));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad("top_p", p, "in (0, 1]");
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return bad("min_p", p, "in [0, 1]");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", self.repetition_penalty, "finite and > 0");
        }
        Ok(())
    }

    /// What this sampling leaves out of `softmax(logits / temperature)`, for a trainer to
    /// replay (none for greedy decoding); settings that keep everything (`top_k = 0`,
    /// `top_p = 1`, `min_p = 0`) are left out.
    pub fn truncation(&self) -> Truncation {
        if !self.do_sample {
            return Truncation::default();
        }
        Truncation {
            token_limit: self.token_limit,
            top_k: self.top_k.filter(|&k| k > 0),
            top_p: self.top_p.filter(|&p| p < 1.0),
            min_p: self.min_p.filter(|&m| m > 0.0),
        }
    }

    /// The random stream of row `row` (counted from `first_row`).
    pub fn row_stream(&self, row: usize) -> SplitMix64 {
        let key = SplitMix64::new(self.first_row + row as u64).next_u64();
        SplitMix64::new(self.seed ^ key)
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            do_sample: false,
            temperature: 1.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: 1.0,
            token_limit: None,
            seed: 0,
            first_row: 0,
        }
    }
}

/// A chosen token and its log-probabilities.
///
/// - `logprob`: under the distribution actually sampled from (temperature, ids past
///   `token_limit` left out, then top-k / top-p / min-p truncation, renormalised). For greedy decoding it equals `untruncated_logprob`.
/// - `untruncated_logprob`: under `softmax(logits / temperature)` without truncation (and
///   without repetition penalty). treetrain's GRPO uses `logprob` as `old_log_probs` and
///   replays the truncation ([`super::Truncation`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Token id.
    pub token: i64,
    /// See the type's documentation.
    pub logprob: f32,
    /// See the type's documentation.
    pub untruncated_logprob: f32,
}

fn log_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

/// Chooses the next token from `logits` `[vocab]`; `seen` are the tokens of the prompt and
/// completion so far (for the repetition penalty).
pub fn choose(logits: &[f32], seen: &[i64], cfg: &SamplingConfig, rng: &mut SplitMix64) -> Choice {
    let temperature = if cfg.do_sample { cfg.temperature.max(1e-6) } else { 1.0 };
    let raw: Vec<f64> = logits.iter().map(|&l| f64::from(l) / temperature).collect();
    let untruncated = log_softmax(&raw);
    let mut scores = penalise_repetitions(raw, seen, cfg.repetition_penalty);
    if let Some(limit) = cfg.token_limit {
        scores.iter_mut().skip(limit).for_each(|s| *s = f64::NEG_INFINITY);
    }
    if !cfg.do_sample {
        let token = scores
            .iter()
            .enumerate()
            .fold(
                (0usize, f64::NEG_INFINITY),
                |best, (i, &s)| if s > best.1 { (i, s) } else { best },
            )
            .0;
        let lp = untruncated[token] as f32;
        return Choice {
            token: token as i64,
            logprob: lp,
            untruncated_logprob: lp,
        };
    }
    let lp = log_softmax(&scores);
    let keep = truncation_mask(&lp, cfg);
    let kept: Vec<f64> = lp
        .iter()
        .zip(&keep)
        .map(|(&l, &k)| if k { l } else { f64::NEG_INFINITY })
        .collect();
    let renorm = log_softmax(&kept);
    let token = draw(&renorm, rng);
    Choice {
        token: token as i64,
        logprob: renorm[token] as f32,
        untruncated_logprob: untruncated[token] as f32,
    }
}

/// transformers' repetition penalty: a seen token's positive score divided by `penalty`, a
/// negative one multiplied, once per distinct token (however often it was seen).
fn penalise_repetitions(mut scores: Vec<f64>, seen: &[i64], penalty: f64) -> Vec<f64> {
    if penalty != 1.0 {
        let mut distinct = seen.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        for t in distinct {
            if let Some(s) = usize::try_from(t).ok().and_then(|t| scores.get_mut(t)) {
                *s = if *s > 0.0 { *s / penalty } else { *s * penalty };
            }
        }
    }
    scores
}

/// Which tokens survive top-k, then top-p (over the survivors, most likely first), then min-p.
fn truncation_mask(lp: &[f64], cfg: &SamplingConfig) -> Vec<bool> {
    let mut keep = vec![true; lp.len()];
    let mut order: Vec<usize> = (0..lp.len()).collect();
    if cfg.top_k.is_some() || cfg.top_p.is_some() {
        order.sort_unstable_by(|&a, &b| lp[b].total_cmp(&lp[a]));
    }
    if let Some(k) = cfg.top_k.filter(|&k| k > 0) {
        for &i in order.iter().skip(k) {
            keep[i] = false;
        }
    }
    if let Some(p) = cfg.top_p.filter(|&p| p < 1.0) {
        let mut cumulative = 0.0;
        for (rank, &i) in order.iter().enumerate() {
            if !keep[i] {
                continue;
            }
            if rank > 0 && cumulative >= p {
                keep[i] = false;
            }
            cumulative += lp[i].exp();
        }
    }
    if let Some(min_p) = cfg.min_p.filter(|&m| m > 0.0) {
        let max = lp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let floor = max + min_p.ln();
        for (i, k) in keep.iter_mut().enumerate() {
            if lp[i] < floor {
                *k = false;
            }
        }
    }
    keep
}

/// A draw from the distribution `log_probs` (`-inf`: excluded); the last kept token when
/// rounding leaves the cumulative sum short of the uniform draw.
fn draw(log_probs: &[f64], rng: &mut SplitMix64) -> usize {
    let u = rng.next_f64();
    let mut acc = 0.0;
    for (i, l) in log_probs.iter().enumerate() {
        if !l.is_finite() {
            continue;
        }
        acc += l.exp();
        if u < acc {
            return i;
        }
    }
    log_probs.iter().rposition(|l| l.is_finite()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_counts(logits: &[f32], cfg: &SamplingConfig, n: usize) -> Vec<usize> {
        let mut rng = SplitMix64::new(cfg.seed);
        let mut counts = vec![0; logits.len()];
        for _ in 0..n {
            counts[choose(logits, &[], cfg, &mut rng).token as usize] += 1;
        }
        counts
    }

    #[test]
    fn greedy_is_argmax_with_untruncated_logprob() {
        let c = choose(
            &[0.0, 2.0, 1.0],
            &[],
            &SamplingConfig::default(),
            &mut SplitMix64::new(0),
        );
        assert_eq!(c.token, 1);
        let want = 2.0 - (1f64 + 2f64.exp() + 1f64.exp()).ln();
        assert!((f64::from(c.logprob) - want).abs() < 1e-6);
    }

    #[test]
    fn sampling_follows_the_truncated_distribution() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let cfg = SamplingConfig {
            do_sample: true,
            seed: 3,
            ..Default::default()
        };
        let counts = sample_counts(&logits, &cfg, 20000);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = f64::from(logits[i]).exp() / z;
            assert!((c as f64 / 20000.0 - p).abs() < 0.015, "token {i}: {c}");
        }
        let top2 = sample_counts(
            &logits,
            &SamplingConfig {
                top_k: Some(2),
                ..cfg.clone()
            },
            2000,
        );
        assert_eq!(top2[0] + top2[1], 0);
        // top-p 0.6: token 3 alone has 0.64 of the mass.
        let nucleus = sample_counts(
            &logits,
            &SamplingConfig {
                top_p: Some(0.6),
                ..cfg.clone()
            },
            500,
        );
        assert_eq!(nucleus[3], 500);
        // min-p 0.3: keeps tokens with p >= 0.3 * p(3): tokens 2 and 3.
        let minp = sample_counts(
            &logits,
            &SamplingConfig {
                min_p: Some(0.3),
                ..cfg.clone()
            },
            2000,
        );
        assert_eq!(minp[0] + minp[1], 0);
        assert!(minp[2] > 0 && minp[3] > 0);
        let mut rng = SplitMix64::new(1);
        let c = choose(
            &logits,
            &[],
            &SamplingConfig {
                top_k: Some(1),
                ..cfg.clone()
            },
            &mut rng,
        );
        assert_eq!((c.token, c.logprob), (3, 0.0));
        assert!(c.untruncated_logprob < -0.4);
        let hot = SamplingConfig {
            temperature: 100.0,
            ..cfg.clone()
        };
        let flat = sample_counts(&logits, &hot, 8000);
        assert!(
            flat.iter().all(|&c| (c as f64 / 8000.0 - 0.25).abs() < 0.03),
            "{flat:?}"
        );
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let cfg = SamplingConfig {
            repetition_penalty: 10.0,
            ..Default::default()
        };
        let c = choose(&[1.0, 2.0, 1.5], &[1], &cfg, &mut SplitMix64::new(0));
        assert_eq!(c.token, 2);
        // Once per distinct token, as transformers applies it: 3.0 / 1.4 = 2.14 still beats
        // 2.0 (twice would give 1.53).
        let once = SamplingConfig {
            repetition_penalty: 1.4,
            ..Default::default()
        };
        let c = choose(&[3.0, 2.0], &[0, 0, 0], &once, &mut SplitMix64::new(0));
        assert_eq!(c.token, 0);
    }
}
