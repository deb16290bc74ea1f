//! GRPO's estimator under top-k / top-p / min-p sampling (`treetrain::generate::Truncation`):
//! on a small fixed vocabulary, the importance-weighted gradient estimate over tokens drawn by
//! the sampler from the old weights has the expectation of the analytic gradient of the
//! expected reward under the current weights' truncated distribution (within 5 standard
//! errors), while the ratio of untruncated log-probs is measurably biased.

use tch::{Kind, Tensor};
use treetrain::generate::{SamplingConfig, Truncation, choose};
use treetrain::util::SplitMix64;

const VOCAB: usize = 8;
const TEMPERATURE: f64 = 0.8;
const DRAWS: usize = 60_000;

/// The old weights' logits and the current ones (a small step away).
fn logits() -> (Vec<f64>, Vec<f64>) {
    let old = [1.2, 0.9, 0.7, 0.4, 0.1, -0.2, -0.5, -0.9];
    let step = [0.05, -0.04, 0.03, 0.02, -0.03, 0.04, -0.02, 0.01];
    (old.to_vec(), old.iter().zip(step).map(|(o, s)| o + s).collect())
}

/// Each token's advantage; not centred, so a missing kept-mass gradient shows.
fn advantage(token: usize) -> f64 {
    1.0 + (token as f64 * 1.3).sin()
}

/// The kept set of `logits` under `t`, by the rules written out (transformers' order: top-k,
/// top-p over the survivors with the most likely always kept, then min-p).
fn kept(logits: &[f64], t: &Truncation) -> Vec<bool> {
    let p = softmax(logits, &vec![true; logits.len()]);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    let mut keep = vec![true; p.len()];
    let mut before = 0.0;
    for (rank, &i) in order.iter().enumerate() {
        let out_k = t.top_k.is_some_and(|k| rank >= k);
        let out_p = t.top_p.is_some_and(|top| rank > 0 && before >= top);
        let out_min = t.min_p.is_some_and(|m| p[i] < m * p[order[0]]);
        keep[i] = !(out_k || out_p || out_min);
        if !out_k {
            before += p[i];
        }
    }
    keep
}

/// `softmax(logits / T)` over the `keep` tokens (0 elsewhere).
fn softmax(logits: &[f64], keep: &[bool]) -> Vec<f64> {
    let e: Vec<f64> = logits
        .iter()
        .zip(keep)
        .map(|(l, &k)| if k { (l / TEMPERATURE).exp() } else { 0.0 })
        .collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// The gradient of `sum_{x in K} q(x) A(x)` in the logits: `q_j (A_j - mean_q A) / T` on `K`.
fn analytic_gradient(logits: &[f64], t: &Truncation) -> Vec<f64> {
    let q = softmax(logits, &kept(logits, t));
    let mean: f64 = q.iter().enumerate().map(|(x, q)| q * advantage(x)).sum();
    (0..VOCAB).map(|j| q[j] * (advantage(j) - mean) / TEMPERATURE).collect()
}

/// Which log-probs the estimator takes its ratio of.
#[derive(Clone, Copy)]
enum Estimator {
    /// `q_θ / q_old`: the truncation replayed, the sampler's own log-probs as old ones.
    Replayed,
    /// `p_θ / p_old`: untruncated log-probs on both sides.
    Untruncated,
}

/// Per draw, the gradient of `ratio * A` in the current logits `[DRAWS, VOCAB]`.
fn per_draw_gradients(t: &Truncation, estimator: Estimator) -> Tensor {
    let (old, new) = logits();
    let cfg = SamplingConfig {
        do_sample: true,
        temperature: TEMPERATURE,
        top_k: t.top_k,
        top_p: t.top_p,
        min_p: t.min_p,
        ..Default::default()
    };
    let old32: Vec<f32> = old.iter().map(|&l| l as f32).collect();
    let mut rng = SplitMix64::new(11);
    let draws: Vec<_> = (0..DRAWS).map(|_| choose(&old32, &[], &cfg, &mut rng)).collect();
    let tokens = Tensor::from_slice(&draws.iter().map(|c| c.token).collect::<Vec<_>>());
    let adv = Tensor::from_slice(
        &draws
            .iter()
            .map(|c| advantage(c.token as usize) as f32)
            .collect::<Vec<_>>(),
    );
    let theta = Tensor::from_slice(&new)
        .to_kind(Kind::Float)
        .view([1, VOCAB as i64])
        .repeat([DRAWS as i64, 1])
        .set_requires_grad(true);
    let scaled = &theta / TEMPERATURE;
    let (logq, old_lp): (Tensor, Vec<f32>) = match estimator {
        Estimator::Replayed => (
            t.logprobs(&scaled, &tokens).unwrap(),
            draws.iter().map(|c| c.logprob).collect(),
        ),
        Estimator::Untruncated => (
            scaled
                .log_softmax(-1, Kind::Float)
                .gather(-1, &tokens.view([-1, 1]), false)
                .squeeze_dim(-1),
            draws.iter().map(|c| c.untruncated_logprob).collect(),
        ),
    };
    let ratio = (logq - Tensor::from_slice(&old_lp)).exp();
    (ratio * adv).sum(Kind::Float).backward();
    theta.grad().to_kind(Kind::Double)
}

/// The largest `|mean - analytic| / standard error` over the vocabulary; a coordinate whose
/// estimates are all equal must equal the analytic value exactly.
fn worst_z(t: &Truncation, estimator: Estimator) -> f64 {
    let grads = per_draw_gradients(t, estimator);
    let mean = Vec::<f64>::try_from(grads.mean_dim(0, false, Kind::Double)).unwrap();
    let se = Vec::<f64>::try_from(grads.std_dim(0, true, false) / (DRAWS as f64).sqrt()).unwrap();
    let want = analytic_gradient(&logits().1, t);
    (0..VOCAB)
        .map(|j| match se[j] > 0.0 {
            true => (mean[j] - want[j]).abs() / se[j],
            false if (mean[j] - want[j]).abs() < 1e-12 => 0.0,
            false => f64::INFINITY,
        })
        .fold(0.0, f64::max)
}

fn truncations() -> [(&'static str, Truncation); 3] {
    let t = Truncation::default();
    [
        ("top_k = 3", Truncation { top_k: Some(3), ..t }),
        ("top_p = 0.7", Truncation { top_p: Some(0.7), ..t }),
        ("min_p = 0.3", Truncation { min_p: Some(0.3), ..t }),
    ]
}

#[test]
fn the_replayed_ratio_is_unbiased_and_the_untruncated_one_is_not() {
    let (old, new) = logits();
    for (name, t) in truncations() {
        // Same kept set for both weights: the estimator's support covers the policy's.
        assert_eq!(kept(&old, &t), kept(&new, &t), "{name}");
        assert!(kept(&old, &t).contains(&false), "{name} truncates nothing");
        let z = worst_z(&t, Estimator::Replayed);
        assert!(z < 5.0, "{name}: replayed estimator {z:.2} standard errors off");
        let biased = worst_z(&t, Estimator::Untruncated);
        assert!(
            biased > 10.0,
            "{name}: the untruncated ratio is only {biased:.2} SE off"
        );
        println!("{name}: replayed {z:.2} SE, untruncated {biased:.1} SE");
    }
}

#[test]
fn a_sampled_token_outside_the_trainers_kept_set_still_counts() {
    // top-k = 1 keeps only the most likely token; a sampler under other rounding drew the
    // second: its log-prob is over {first, second}, finite.
    let logits = Tensor::from_slice(&[2.0f32, 1.0, 0.0, -1.0]).view([1, 4]);
    let t = Truncation {
        top_k: Some(1),
        ..Default::default()
    };
    let got = t
        .logprobs(&logits, &Tensor::from_slice(&[1i64]))
        .unwrap()
        .double_value(&[0]);
    let want = 1.0 - (2f64.exp() + 1f64.exp()).ln();
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
}

#[test]
fn the_replay_scores_a_sampled_token_as_the_sampler_did() {
    // On random logits, every truncation (and the token limit, and combinations): the loss's
    // log-prob of the drawn token equals the sampler's own, so an on-policy ratio is 1.
    let mut rng = SplitMix64::new(5);
    let vocab = 64;
    for (i, (top_k, top_p, min_p, token_limit)) in [
        (Some(5), None, None, None),
        (None, Some(0.6), None, None),
        (None, None, Some(0.05), None),
        (None, None, None, Some(50)),
        (Some(20), Some(0.9), Some(0.02), Some(40)),
    ]
    .into_iter()
    .enumerate()
    {
        let cfg = SamplingConfig {
            do_sample: true,
            temperature: 0.7,
            top_k,
            top_p,
            min_p,
            token_limit,
            ..Default::default()
        };
        let t = cfg.truncation();
        for _ in 0..50 {
            let logits: Vec<f32> = (0..vocab).map(|_| (rng.next_f64() * 6.0 - 3.0) as f32).collect();
            let c = choose(&logits, &[], &cfg, &mut rng);
            let scaled = Tensor::from_slice(&logits).view([1, vocab as i64]) / 0.7;
            let got = t
                .logprobs(&scaled, &Tensor::from_slice(&[c.token]))
                .unwrap()
                .double_value(&[0]);
            assert!(
                (got - f64::from(c.logprob)).abs() < 1e-5,
                "setting {i}: {got} vs {}",
                c.logprob
            );
        }
    }
}
