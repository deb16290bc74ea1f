//! The sampler of a decode step on the CPU (`cpu_sampler.cpp`): the host sampler's choice for
//! every row in f64, one exp pass over the vocabulary per row, top-k / top-p over the head of
//! the distribution only. [`choose_rows`] takes it for f32 logits on the CPU (on a CPU with
//! AVX2 + FMA); the tensor-op path (`device_sampling`) serves every other device.
//!
//! It equals the host sampler ([`super::choose`]) up to the order of its f64 sums and SLEEF's
//! 1-ulp exp: a token can differ only when a uniform falls within ~1e-15 of a boundary of the
//! cumulative distribution.

use tch::{Kind, Tensor};

use super::device_sampling::{BatchChoice, choose_rows_with_tensors};
use super::sampling::SamplingConfig;
use crate::model::cpu_kernels::{KernelIsa, kernel_isa};

/// Chooses every row's next token from `logits` on their device: on the CPU by the sampler
/// kernel (this file's), elsewhere in tensor ops ([`choose_rows_with_tensors`]).
///
/// # Shapes
/// - `logits`: `[batch, vocab]`, any float kind.
/// - `seen`: `[batch, vocab]` bool ([`seen_mask`]), used when `cfg.repetition_penalty != 1`.
/// - `uniforms`: one draw in `[0, 1)` per row (ignored when greedy).
pub(crate) fn choose_rows(
    logits: &Tensor,
    seen: Option<&Tensor>,
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> Result<BatchChoice, tch::TchError> {
    match choose_rows_on_cpu(logits, seen, cfg, uniforms) {
        Some(choice) => Ok(choice),
        None => choose_rows_with_tensors(logits, seen, cfg, uniforms),
    }
}

unsafe extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn tt_choose_rows(
        logits: *const f32,
        rows: i64,
        vocab: i64,
        seen: *const bool,
        sample: std::ffi::c_int,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        min_p: f64,
        penalty: f64,
        allowed: i64,
        uniforms: *const f64,
        tokens: *mut i64,
        logprob: *mut f64,
        untruncated: *mut f64,
    );
}

/// Every row's choice from `logits` `[rows, vocab]` (f32 on the CPU), or `None` when this
/// sampler does not apply (another device or dtype, no AVX2 + FMA): the caller then uses the
/// tensor ops. Shapes as [`choose_rows`].
fn choose_rows_on_cpu(
    logits: &Tensor,
    seen: Option<&Tensor>,
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> Option<BatchChoice> {
    let [rows, vocab] = logits.size()[..] else { return None };
    let on_cpu = |t: &Tensor| t.device() == tch::Device::Cpu;
    let seen = seen.filter(|_| cfg.repetition_penalty != 1.0);
    let fits = on_cpu(logits)
        && logits.kind() == Kind::Float
        && vocab > 0
        && seen.is_none_or(|s| on_cpu(s) && s.kind() == Kind::Bool && s.size() == [rows, vocab])
        && kernel_isa() != KernelIsa::Unsupported;
    if !fits {
        return None;
    }
    let logits = logits.contiguous();
    let seen = seen.map(Tensor::contiguous);
    let n = rows as usize;
    let mut u = uniforms.to_vec();
    u.resize(n, 0.0);
    let (mut tokens, mut logprob, mut untruncated) = (vec![0i64; n], vec![0f64; n], vec![0f64; n]);
    // SAFETY: logits is contiguous f32 [rows, vocab] and seen (when given) contiguous bool of the
    // same shape, both on the CPU (checked); u and the three outputs hold `rows` values each; the
    // kernel reads the inputs and writes one value per row into each output.
    unsafe {
        tt_choose_rows(
            logits.data_ptr() as *const f32,
            rows,
            vocab,
            seen.as_ref().map_or(std::ptr::null(), |s| s.data_ptr() as *const bool),
            i32::from(cfg.do_sample),
            cfg.temperature,
            cfg.top_k.map_or(0, |k| k as i64),
            cfg.top_p.unwrap_or(1.0),
            cfg.min_p.unwrap_or(0.0),
            cfg.repetition_penalty,
            cfg.token_limit.map_or(vocab, |l| (l as i64).min(vocab)),
            u.as_ptr(),
            tokens.as_mut_ptr(),
            logprob.as_mut_ptr(),
            untruncated.as_mut_ptr(),
        )
    };
    Some(BatchChoice {
        tokens,
        logprobs: logprob.into_iter().map(|l| l as f32).collect(),
        untruncated_logprobs: untruncated.into_iter().map(|l| l as f32).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::generate::choose;
    use crate::generate::device_sampling::seen_mask;
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
