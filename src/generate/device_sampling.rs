//! The sampler where the logits are: the same choice as [`super::choose`] for every row of a
//! batch at once, in tensor ops on the logits' device, so a decode step sends back only the
//! chosen ids and their two log-probabilities (`3 x batch` numbers) instead of the whole
//! `[batch, vocab]` logits (78 MB a step for 128 rows of Qwen3's 151,936-token vocabulary).
//!
//! The randomness stays treetrain's own: one uniform per sampling row and step from the row's
//! [`SamplingConfig::row_stream`], as the host sampler draws, and the token is found by
//! inverse CDF over the kept distribution in vocabulary order, as the host sampler walks it.
//! Both compute in f64, so on the CPU the same seed gives the same tokens (the sums are taken
//! in another order, which can move a token only when a uniform falls within ~1e-15 of a
//! boundary).
//!
//! On the CPU, f32 logits go to the CPU sampler instead (`cpu_sampler.rs`: the same rule in
//! one pass per row, where these tensor ops make tens of passes over the vocabulary); this
//! module serves every other device and dtype.

use tch::{Kind, Tensor};

use super::sampling::SamplingConfig;
use crate::device::Device;
use crate::model::Truncation;

/// The chosen token of every row of a batch and its log-probabilities (see
/// [`super::Choice`] for what each means).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchChoice {
    /// Token id per row.
    pub tokens: Vec<i64>,
    /// Log-probability under the distribution sampled from (truncated, renormalised).
    pub logprobs: Vec<f32>,
    /// Log-probability under `softmax(logits / temperature)`, untruncated.
    pub untruncated_logprobs: Vec<f32>,
}

/// A `[batch, vocab]` presence mask of the tokens each row has seen (prompt and completion so
/// far), for the repetition penalty: transformers' penalty applies once per distinct token.
///
/// # Shapes
/// `rows[r]` are row `r`'s tokens; the mask is `[rows.len(), vocab]` bool on `device`.
pub fn seen_mask(rows: &[Vec<i64>], vocab: i64, device: Device) -> Result<Tensor, tch::TchError> {
    let mask = device.zeros(&[rows.len() as i64, vocab], Kind::Bool)?;
    for (r, ids) in rows.iter().enumerate() {
        if !ids.is_empty() {
            let index = device.from_slice(ids)?;
            let _ = mask.f_get(r as i64)?.f_index_fill_(0, &index, 1)?;
        }
    }
    Ok(mask)
}

/// Chooses every row's next token from `logits` on their device: on the CPU by the sampler
/// kernel (`generate::cpu_sampler`), elsewhere in tensor ops ([`choose_rows_with_tensors`]).
///
/// # Shapes
/// - `logits`: `[batch, vocab]`, any float kind.
/// - `seen`: `[batch, vocab]` bool ([`seen_mask`]), used when `cfg.repetition_penalty != 1`.
/// - `uniforms`: one draw in `[0, 1)` per row (ignored when greedy).
pub fn choose_rows(
    logits: &Tensor,
    seen: Option<&Tensor>,
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> Result<BatchChoice, tch::TchError> {
    match super::cpu_sampler::choose_rows(logits, seen, cfg, uniforms) {
        Some(choice) => Ok(choice),
        None => choose_rows_with_tensors(logits, seen, cfg, uniforms),
    }
}

/// [`choose_rows`] in tensor ops on the logits' device: what runs off the CPU (and is tested
/// on the CPU against the host sampler like the CPU kernel).
pub fn choose_rows_with_tensors(
    logits: &Tensor,
    seen: Option<&Tensor>,
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> Result<BatchChoice, tch::TchError> {
    let temperature = if cfg.do_sample { cfg.temperature.max(1e-6) } else { 1.0 };
    // 1. Scores in f64, as the host sampler computes: raw = logits / T.
    let raw = logits.f_to_kind(Kind::Double)?.f_div_scalar(temperature)?;
    let log_z = raw.f_logsumexp([-1], true)?;
    // 2. The repetition penalty (transformers' rule) on the tokens seen; ids past `token_limit`
    //    score -inf.
    let mut scores = match seen.filter(|_| cfg.repetition_penalty != 1.0) {
        Some(seen) => penalised(&raw, seen, cfg.repetition_penalty)?,
        None => raw.shallow_clone(),
    };
    let vocab = raw.size().last().copied().unwrap_or(0);
    let limit = cfg.token_limit.map(|l| l as i64).filter(|&l| l < vocab);
    if let Some(limit) = limit {
        let beyond = Device::of(&raw).arange(vocab, Kind::Int64)?.f_ge(limit)?;
        scores = scores.f_masked_fill(&beyond.f_view([1, vocab])?, f64::NEG_INFINITY)?;
    }
    // 3. The token: argmax (first of ties), or an inverse-CDF draw from the kept distribution.
    let (token, logprob) = if cfg.do_sample {
        let lp = scores.f_log_softmax(-1, Kind::Double)?;
        // The ids past the limit are already -inf in `lp`, which `kept` leaves out.
        let keep = Truncation {
            token_limit: None,
            ..cfg.truncation()
        }
        .kept(&lp)?;
        let renorm = lp
            .f_masked_fill(&keep.f_logical_not()?, f64::NEG_INFINITY)?
            .f_log_softmax(-1, Kind::Double)?;
        let token = inverse_cdf(&renorm, &keep, uniforms)?;
        let logprob = renorm.f_gather(-1, &token, false)?;
        (token, logprob)
    } else {
        let token = scores.f_argmax(-1, true)?;
        let logprob = raw.f_gather(-1, &token, false)?.f_sub(&log_z)?;
        (token, logprob)
    };
    let untruncated = raw.f_gather(-1, &token, false)?.f_sub(&log_z)?;
    // 4. One transfer back: [batch, 3] of (token, logprob, untruncated logprob).
    let packed = Tensor::f_cat(&[token.f_to_kind(Kind::Double)?, logprob, untruncated], 1)?;
    let host = Vec::<f64>::try_from(Device::to_host(&packed)?.f_contiguous()?.f_view([-1])?)?;
    let column = |c: usize| host.iter().skip(c).step_by(3).copied();
    Ok(BatchChoice {
        tokens: column(0).map(|t| t as i64).collect(),
        logprobs: column(1).map(|l| l as f32).collect(),
        untruncated_logprobs: column(2).map(|l| l as f32).collect(),
    })
}

/// transformers' repetition penalty: a seen token's positive score divided by `penalty`, a
/// negative one multiplied; once per distinct token.
fn penalised(raw: &Tensor, seen: &Tensor, penalty: f64) -> Result<Tensor, tch::TchError> {
    let positive = raw.f_gt(0.0)?;
    let penalty_applied = raw
        .f_div_scalar(penalty)?
        .f_where_self(&positive, &raw.f_mul_scalar(penalty)?)?;
    penalty_applied.f_where_self(seen, raw)
}

/// The first token whose cumulative probability (vocabulary order) exceeds the row's uniform,
/// or the last kept token when rounding leaves the sum short of it.
///
/// # Shapes
/// `renorm`, `keep`: `[batch, vocab]`; returns `[batch, 1]` int64.
fn inverse_cdf(renorm: &Tensor, keep: &Tensor, uniforms: &[f64]) -> Result<Tensor, tch::TchError> {
    let (batch, vocab) = renorm.size2()?;
    let device = Device::of(renorm);
    let mut u = uniforms.to_vec();
    u.resize(batch as usize, 0.0);
    let u = device.from_slice(&u)?.f_view([batch, 1])?;
    let cdf = renorm.f_exp()?.f_cumsum(-1, Kind::Double)?;
    let below = cdf
        .f_le_tensor(&u)?
        .f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Int64)?;
    let index = device.arange(vocab, Kind::Int64)?.f_view([1, vocab])?;
    let last_kept = index
        .f_where_self(keep, &device.put(&Tensor::from(-1i64))?)?
        .f_amax([-1], true)?;
    below.f_minimum(&last_kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::choose;
    use crate::util::SplitMix64;

    fn logits(rows: usize, vocab: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..rows * vocab).map(|_| (rng.next_f64() * 8.0 - 4.0) as f32).collect()
    }

    /// Both batch samplers (the CPU kernel behind `choose_rows`, and the tensor ops) against
    /// the host one, row by row, on the same uniforms.
    fn check_equal(cfg: &SamplingConfig, seen: &[Vec<i64>], rows: usize, vocab: usize) {
        check_equal_on(cfg, seen, &logits(rows, vocab, cfg.seed + 17), rows, vocab);
    }

    fn check_equal_on(cfg: &SamplingConfig, seen: &[Vec<i64>], flat: &[f32], rows: usize, vocab: usize) {
        let t = Tensor::from_slice(flat).view([rows as i64, vocab as i64]);
        let mask = seen_mask(seen, vocab as i64, Device::Cpu).unwrap();
        let mut streams: Vec<SplitMix64> = (0..rows).map(|r| cfg.row_stream(r)).collect();
        let host: Vec<_> = (0..rows)
            .map(|r| choose(&flat[r * vocab..(r + 1) * vocab], &seen[r], cfg, &mut streams[r]))
            .collect();
        let uniforms: Vec<f64> = (0..rows).map(|r| cfg.row_stream(r).next_f64()).collect();
        for device in [
            choose_rows(&t, Some(&mask), cfg, &uniforms).unwrap(),
            choose_rows_with_tensors(&t, Some(&mask), cfg, &uniforms).unwrap(),
        ] {
            same_choices(&device, &host, cfg);
        }
    }

    fn same_choices(device: &BatchChoice, host: &[crate::generate::Choice], cfg: &SamplingConfig) {
        for (r, h) in host.iter().enumerate() {
            assert_eq!(device.tokens[r], h.token, "row {r} of {cfg:?}");
            assert!(
                (device.logprobs[r] - h.logprob).abs() < 1e-5,
                "row {r}: {} vs {}",
                device.logprobs[r],
                h.logprob
            );
            assert!(
                (device.untruncated_logprobs[r] - h.untruncated_logprob).abs() < 1e-5,
                "row {r}"
            );
        }
    }

    #[test]
    fn every_setting_chooses_what_the_host_sampler_chooses() {
        let sample = SamplingConfig {
            do_sample: true,
            ..Default::default()
        };
        let configs = [
            SamplingConfig::default(),
            sample.clone(),
            SamplingConfig {
                temperature: 0.7,
                top_k: Some(5),
                ..sample.clone()
            },
            SamplingConfig {
                top_p: Some(0.8),
                ..sample.clone()
            },
            SamplingConfig {
                min_p: Some(0.1),
                temperature: 1.3,
                ..sample.clone()
            },
            SamplingConfig {
                top_k: Some(20),
                top_p: Some(0.9),
                min_p: Some(0.05),
                ..sample.clone()
            },
            SamplingConfig {
                repetition_penalty: 1.7,
                top_p: Some(0.95),
                ..sample.clone()
            },
            SamplingConfig {
                repetition_penalty: 3.0,
                ..SamplingConfig::default()
            },
            SamplingConfig {
                token_limit: Some(60),
                top_k: Some(80),
                ..sample.clone()
            },
            SamplingConfig {
                token_limit: Some(60),
                min_p: Some(0.02),
                repetition_penalty: 1.3,
                ..sample.clone()
            },
            SamplingConfig {
                token_limit: Some(90),
                ..SamplingConfig::default()
            },
        ];
        let (rows, vocab) = (64, 97);
        let seen: Vec<Vec<i64>> = (0..rows as i64)
            .map(|r| vec![r % 97, (r * 7) % 97, r % 97, 3])
            .collect();
        for (i, cfg) in configs.iter().enumerate() {
            for seed in 0..4 {
                check_equal(
                    &SamplingConfig {
                        seed: seed * 31 + i as u64,
                        ..cfg.clone()
                    },
                    &seen,
                    rows,
                    vocab,
                );
            }
        }
    }

    /// Padding rows of the LM head (ids past the tokenizer's vocabulary) are never chosen, even
    /// when they are the most likely, greedy or sampled, by all three samplers; the untruncated
    /// log-prob still counts their mass.
    #[test]
    fn ids_past_the_token_limit_are_never_chosen() {
        let (rows, vocab, limit) = (32, 50, 40);
        let mut flat = logits(rows, vocab, 5);
        for r in 0..rows {
            flat[r * vocab + limit..(r + 1) * vocab].fill(6.0);
        }
        let seen = vec![Vec::new(); rows];
        for (do_sample, top_k) in [(false, None), (true, None), (true, Some(45))] {
            let cfg = SamplingConfig {
                do_sample,
                top_k,
                token_limit: Some(limit),
                seed: 3,
                ..Default::default()
            };
            check_equal_on(&cfg, &seen, &flat, rows, vocab);
            let t = Tensor::from_slice(&flat).view([rows as i64, vocab as i64]);
            let uniforms: Vec<f64> = (0..rows).map(|r| cfg.row_stream(r).next_f64()).collect();
            let got = choose_rows(&t, None, &cfg, &uniforms).unwrap();
            let full = t.to_kind(Kind::Double).log_softmax(-1, Kind::Double);
            for (r, &token) in got.tokens.iter().enumerate() {
                assert!((token as usize) < limit, "row {r} chose padding id {token}");
                let want = full.double_value(&[r as i64, token]);
                assert!((f64::from(got.untruncated_logprobs[r]) - want).abs() < 1e-5, "row {r}");
            }
        }
    }

    #[test]
    fn a_nucleus_wider_than_the_kernel_s_first_head_is_found_whole() {
        // Nearly flat logits over 3,000 tokens: top-p 0.9 keeps ~2,700 of them, past the 256
        // the CPU kernel sorts first, so it widens its head until the nucleus is decided.
        let (rows, vocab) = (4, 3000);
        let mut rng = SplitMix64::new(9);
        let flat: Vec<f32> = (0..rows * vocab).map(|_| (rng.next_f64() * 0.2 - 0.1) as f32).collect();
        let seen = vec![Vec::new(); rows];
        for (top_k, top_p) in [(None, Some(0.9)), (Some(1000), Some(0.9)), (Some(300), None)] {
            let cfg = SamplingConfig {
                do_sample: true,
                top_k,
                top_p,
                seed: 4,
                ..Default::default()
            };
            check_equal_on(&cfg, &seen, &flat, rows, vocab);
        }
    }

    #[test]
    fn draws_follow_the_kept_distribution() {
        // One fixed logits vector in 40,000 rows, each with its own uniform.
        let base = [0.0f32, 1.0, 2.0, 3.0, -1.0];
        let n = 40_000usize;
        let t = Tensor::from_slice(&base).view([1, 5]).repeat([n as i64, 1]);
        let mut rng = SplitMix64::new(5);
        let uniforms: Vec<f64> = (0..n).map(|_| rng.next_f64()).collect();
        let counts = |cfg: &SamplingConfig, tensors: bool| {
            let c = match tensors {
                true => choose_rows_with_tensors(&t, None, cfg, &uniforms).unwrap(),
                false => choose_rows(&t, None, cfg, &uniforms).unwrap(),
            };
            let mut k = [0usize; 5];
            c.tokens.iter().for_each(|&t| k[t as usize] += 1);
            k
        };
        let expect = |kept: &[usize]| {
            let z: f64 = kept.iter().map(|&i| f64::from(base[i]).exp()).sum();
            (0..5)
                .map(|i| {
                    if kept.contains(&i) {
                        f64::from(base[i]).exp() / z
                    } else {
                        0.0
                    }
                })
                .collect::<Vec<_>>()
        };
        let sample = SamplingConfig {
            do_sample: true,
            ..Default::default()
        };
        for (cfg, kept) in [
            (sample.clone(), vec![0, 1, 2, 3, 4]),
            (
                SamplingConfig {
                    top_k: Some(2),
                    ..sample.clone()
                },
                vec![2, 3],
            ),
            // top-p 0.9: 3 (0.63), 2 (0.23) leave 0.86 < 0.9, so 1 (0.09) stays too.
            (
                SamplingConfig {
                    top_p: Some(0.9),
                    ..sample.clone()
                },
                vec![1, 2, 3],
            ),
            (
                SamplingConfig {
                    min_p: Some(0.3),
                    ..sample.clone()
                },
                vec![2, 3],
            ),
        ] {
            for tensors in [false, true] {
                let (k, p) = (counts(&cfg, tensors), expect(&kept));
                for i in 0..5 {
                    let f = k[i] as f64 / n as f64;
                    // 5 standard errors of a binomial proportion.
                    let bound = 5.0 * (p[i] * (1.0 - p[i]) / n as f64).sqrt() + 1e-12;
                    assert!((f - p[i]).abs() <= bound, "{cfg:?} token {i}: {f} vs {}", p[i]);
                }
            }
        }
    }

    #[test]
    fn a_uniform_past_the_rounded_total_takes_the_last_kept_token() {
        let t = Tensor::from_slice(&[5.0f32, 1.0, 4.0, -2.0]).view([1, 4]);
        let cfg = SamplingConfig {
            do_sample: true,
            top_k: Some(2),
            ..Default::default()
        };
        for c in [
            choose_rows(&t, None, &cfg, &[1.0]).unwrap(),
            choose_rows_with_tensors(&t, None, &cfg, &[1.0]).unwrap(),
        ] {
            assert_eq!(c.tokens, vec![2]);
        }
    }
}
