//! The GRPO objective over a packed row: the clipped surrogate of the importance ratio, an
//! optional KL penalty to a frozen reference, the entropy bonus, and the weights that normalise
//! loss terms over a whole step (TRL's `loss_type`), all from the policy's log-prob of each loss
//! term. The same for tree and flat rows: the row's loss terms are one contract
//! ([`PackedRow`]).

use tch::{Kind, Tensor};

use super::config::LossType;
use super::objective::GrpoObjective;
use super::policy_terms::{importance_ratio, off_policy_mask, policy_terms, sampling_weights};
use crate::device::Device;
use crate::model::ModelError;
use crate::pack::PackedRow;

/// Per-term log-probs `[M]` of a row from other forwards than the policy's own.
#[derive(Debug, Clone, Copy, Default)]
pub struct TermLogprobs<'a> {
    /// The frozen reference model's, for the KL penalty (used when `beta > 0`).
    pub reference: Option<&'a Tensor>,
    /// The policy's own at the start of the update, for [`super::SamplingCorrection`].
    pub before_update: Option<&'a Tensor>,
}

/// The policy's entropy at every loss term `[M]` of a row.
#[derive(Debug, Clone, Copy)]
pub struct TermEntropies<'a> {
    /// As the step's entropy floor was measured (no gradient): which terms train.
    pub measured: &'a Tensor,
    /// The same with its gradient, for the entropy bonus (`None`: the bonus, if on, has no
    /// gradient to give).
    pub differentiable: Option<&'a Tensor>,
}

/// How each loss term is weighted in the sum that becomes a row's loss.
#[derive(Debug, Clone, PartialEq)]
pub enum TermWeights {
    /// Every term times this (1 / the loss terms of the window: token-level normalisation).
    Uniform(f64),
    /// One weight per loss term `[M]` (e.g. 1 / (the term's rollout length x rollouts):
    /// sequence-level normalisation).
    PerTerm(Vec<f32>),
}

impl GrpoObjective {
    /// The weights of `row`'s loss terms in a step of `totals` (counted over the whole step,
    /// every row and rank):
    ///
    /// - `Dapo`, `Cispo`, `Vespo`: every term / all loss terms of the step (token level).
    /// - `Grpo`, `Sapo`: every term / (its rollout's terms x rollouts of the step): each
    ///   rollout's mean, then the mean over rollouts.
    /// - `Luspo`: every term / rollouts of the step: each rollout's sum, then the mean.
    /// - `DrGrpo`: every term / (rollouts x `max_completion_length`).
    /// - `Bnpo`: every term / (its micro-batch's terms x micro-batches of the step), a
    ///   micro-batch being `per_device_train_batch_size` consecutive rollouts of the step:
    ///   each micro-batch's token mean, then the mean over micro-batches.
    pub(crate) fn term_weights(&self, row: &PackedRow, totals: &super::StepTotals) -> Result<TermWeights, ModelError> {
        let (terms, rollouts) = (totals.terms, totals.rollouts.max(1));
        Ok(match self.loss_type {
            LossType::Bnpo => {
                let size = self.per_device_train_batch_size.max(1);
                let per_batch: Vec<usize> = totals.rollout_terms.chunks(size).map(|c| c.iter().sum()).collect();
                let batches = per_batch.len().max(1);
                let weights = row.segment_id.iter().map(|&s| {
                    let source = row.sources.get(s as usize).copied().ok_or_else(|| {
                        ModelError::Input(format!("packed row: segment_id {s} but {} sources", row.sources.len()))
                    })?;
                    let in_batch = per_batch.get(source / size).copied().unwrap_or(0).max(1);
                    Ok(1.0 / (in_batch * batches) as f32)
                });
                TermWeights::PerTerm(weights.collect::<Result<_, ModelError>>()?)
            }
            LossType::Dapo | LossType::Cispo | LossType::Vespo => TermWeights::Uniform(1.0 / terms.max(1) as f64),
            LossType::DrGrpo => TermWeights::Uniform(1.0 / (rollouts * self.max_completion_length.max(1)) as f64),
            LossType::Luspo => TermWeights::Uniform(1.0 / rollouts as f64),
            LossType::Grpo | LossType::Sapo => {
                let mut count = vec![0usize; row.rollouts];
                for &s in &row.segment_id {
                    *count.get_mut(s as usize).ok_or_else(|| {
                        ModelError::Input(format!(
                            "packed row: segment_id {s} but the row holds {} rollouts",
                            row.rollouts
                        ))
                    })? += 1;
                }
                TermWeights::PerTerm(
                    row.segment_id
                        .iter()
                        .map(|&s| 1.0 / (count[s as usize] * rollouts) as f32)
                        .collect(),
                )
            }
        })
    }
}

impl GrpoObjective {
    /// The weights of `row`'s loss terms in a step made of that row alone.
    pub fn row_weights(&self, row: &PackedRow) -> Result<TermWeights, ModelError> {
        self.term_weights(row, &super::StepTotals::of([row]))
    }
}

/// The loss of one packed row and what it was made of.
#[derive(Debug)]
pub struct GrpoLoss {
    /// Scalar: sum of per-term losses / normalizer.
    pub loss: Tensor,
    /// Policy log-prob of every loss term `[M]` (f32, differentiable).
    pub logprobs: Tensor,
    /// Loss terms `M`.
    pub num_terms: usize,
    /// Share of terms where clipping is active: ratio above `1 + eps_high` with a positive
    /// advantage, or below `1 - eps_low` with a negative one (TRL's `clip_ratio/region_mean`).
    pub clip_fraction: f64,
    /// Share of terms clipped below (`clip_ratio/low_mean`).
    pub clip_low_fraction: f64,
    /// Share of terms clipped above (`clip_ratio/high_mean`).
    pub clip_high_fraction: f64,
    /// Sum over terms of the `k3` estimate of `KL(old || policy)` (the tokens were sampled from
    /// the old weights): how far the policy has moved since generation (0 for the same weights).
    pub approx_kl_sum: f64,
    /// Sum over terms of the `k3` estimate of `KL(policy || reference)`, as TRL penalises it (0
    /// without a reference).
    pub ref_kl_sum: f64,
    /// Sum over terms of the policy's entropy (nats) at the predicting position.
    pub entropy_sum: f64,
    /// Sum over terms of the sampling-correction weight (`num_terms` when uncorrected).
    pub correction_sum: f64,
    /// Sum over the trained terms (those at or above the entropy floor) of the policy's
    /// entropy: what the entropy bonus and its adaptive controller average.
    pub kept_entropy_sum: f64,
    /// The row's load-balancing loss (without its coefficient) when a mixture model's router
    /// loss was added to the backward.
    pub aux_loss: Option<f64>,
}

/// `k3 = exp(q - p) - (q - p) - 1` per term: an unbiased, non-negative estimate of
/// `KL(P || Q)` from samples of `P` (log-probs `p` under `P`, `q` under `Q`).
fn k3(sampled: &Tensor, other: &Tensor) -> Tensor {
    let d = other - sampled;
    d.exp() - &d - 1.0
}

/// The GRPO loss of `row` from the policy's log-prob of each of its loss terms (`logprobs`
/// `[M]`, f32, differentiable) and, for `top_entropy_quantile` and the entropy bonus, each
/// term's entropy:
/// everything [`super::grpo_loss_backward`] computes after the model's forward, so an objective can
/// be checked (or driven) on log-probs alone. `entropy_sum` is left 0 here.
pub fn grpo_loss_of_logprobs(
    row: &PackedRow,
    logprobs: Tensor,
    term_entropies: Option<TermEntropies<'_>>,
    cfg: &GrpoObjective,
    weights: TermWeights,
    other: TermLogprobs<'_>,
) -> Result<GrpoLoss, ModelError> {
    let device = Device::of(&logprobs);
    let m = row.token_index.len();
    if logprobs.size() != [m as i64] {
        return Err(ModelError::Input(format!(
            "{:?} log-probs for a row of {m} loss terms",
            logprobs.size()
        )));
    }
    // 1. The ratio `[M]` against the sampling weights, or against the policy at update start
    //    with a (detached) sampling-correction weight per term.
    let (old, correction) = ratio_baseline(row, cfg, other.before_update, device)?;
    let adv = device.from_slice(&row.advantages)?;
    let ratio = importance_ratio(row, &logprobs, &old, cfg.importance_sampling)?;
    // 2. The policy term of the loss type, masked for off-policy rollouts and below the entropy
    //    floor (TRL masks the policy term only; the KL penalty still applies to every term) and
    //    weighted by the correction (which VESPO folds into its own weight instead).
    let mut per_term = policy_terms(row, &logprobs, &old, &ratio, &adv, correction.as_ref(), cfg)?;
    if let Some(threshold) = cfg.off_policy_mask_threshold {
        per_term = per_term.f_mul(&off_policy_mask(row, &logprobs, &adv, threshold)?)?;
    }
    let kept = match (cfg.entropy_floor, term_entropies) {
        (Some(floor), Some(e)) => Some(e.measured.f_ge(floor)?.f_to_kind(Kind::Float)?),
        _ => None,
    };
    if let Some(kept) = &kept {
        per_term = per_term.f_mul(kept)?;
    }
    let correction_sum = match &correction {
        Some(w) => {
            if cfg.loss_type != LossType::Vespo {
                per_term = per_term.f_mul(w)?;
            }
            tch::no_grad(|| w.f_sum(Kind::Float)?.f_double_value(&[]))?
        }
        None => m as f64,
    };
    // 3. `beta` x k3 to the reference, then the terms summed under the averaging's weights.
    let (per_term, ref_kl_sum) = with_reference_kl(per_term, &logprobs, &ratio, other.reference, cfg, device)?;
    let mut loss = weigh_terms(per_term, weights, device)?;
    // 4. The entropy bonus, taken off the loss.
    let (bonus, kept_entropy_sum) = entropy_bonus(term_entropies, kept.as_ref(), cfg, m)?;
    if let Some(bonus) = bonus {
        loss = loss.f_sub(&bonus)?;
    }
    // 5. The statistics, outside the graph.
    let (clips, approx_kl_sum) = clip_statistics(&ratio, &adv, &old, &logprobs, cfg);
    let [clip_fraction, clip_low_fraction, clip_high_fraction] = clips;
    Ok(GrpoLoss {
        loss,
        logprobs,
        num_terms: m,
        clip_fraction,
        clip_low_fraction,
        clip_high_fraction,
        approx_kl_sum,
        ref_kl_sum,
        entropy_sum: 0.0,
        kept_entropy_sum,
        correction_sum,
        aux_loss: None,
    })
}

/// The entropy bonus (`entropy_coef` x the mean entropy over the step's trained terms, with
/// its gradient; `None` when off) and the sum of the trained terms' entropies. Not reweighted
/// by the loss type: the same bonus whatever the policy term's normalisation, as TRL.
fn entropy_bonus(
    term_entropies: Option<TermEntropies<'_>>,
    kept: Option<&Tensor>,
    cfg: &GrpoObjective,
    m: usize,
) -> Result<(Option<Tensor>, f64), ModelError> {
    let Some(e) = term_entropies else {
        return Ok((None, 0.0));
    };
    let entropies = e.differentiable.unwrap_or(e.measured);
    let sum = match kept {
        Some(k) => entropies.f_mul(k)?,
        None => entropies.shallow_clone(),
    }
    .f_sum(Kind::Float)?;
    let value = tch::no_grad(|| sum.f_double_value(&[]))?;
    if cfg.entropy_coef == 0.0 {
        return Ok((None, value));
    }
    let count = match (cfg.entropy_terms, kept) {
        (Some(n), _) => n as f64,
        (None, Some(k)) => tch::no_grad(|| k.f_sum(Kind::Float)?.f_double_value(&[]))?,
        (None, None) => m as f64,
    };
    Ok((Some(sum.f_mul_scalar(cfg.entropy_coef / count.max(1.0))?), value))
}

/// What the ratio is taken against `[M]`: the sampling weights' log-probs, or with a sampling
/// correction the policy's at update start, with each term's correction weight.
fn ratio_baseline(
    row: &PackedRow,
    cfg: &GrpoObjective,
    before_update: Option<&Tensor>,
    device: Device,
) -> Result<(Tensor, Option<Tensor>), ModelError> {
    let sampled = device.from_slice(&row.old_log_probs)?;
    Ok(match (cfg.sampling_correction, before_update) {
        (Some(c), Some(before)) => {
            let before = device.put(before)?.f_to_kind(Kind::Float)?;
            let w = sampling_weights(row, &before, &sampled, c)?;
            (before, Some(w))
        }
        _ => (sampled, None),
    })
}

/// `per_term + beta x k3(reference, policy)` (with `bias_corrected_kl`, each k3 times the
/// ratio before clipping, with its gradient, as TRL multiplies it in; the sampling correction
/// weighs the policy term only, never this one), and the k3 sum; unchanged without a
/// reference or with `beta = 0`.
fn with_reference_kl(
    per_term: Tensor,
    logprobs: &Tensor,
    ratio: &Tensor,
    reference: Option<&Tensor>,
    cfg: &GrpoObjective,
    device: Device,
) -> Result<(Tensor, f64), ModelError> {
    let Some(reference) = reference.filter(|_| cfg.beta > 0.0) else {
        return Ok((per_term, 0.0));
    };
    if reference.size() != logprobs.size() {
        return Err(ModelError::Input(format!(
            "reference log-probs have shape {:?}, the row has {} loss terms",
            reference.size(),
            logprobs.size()[0]
        )));
    }
    let mut kl = k3(logprobs, &device.put(reference)?.f_to_kind(Kind::Float)?);
    if cfg.bias_corrected_kl {
        kl = kl.f_mul(ratio)?;
    }
    let sum = tch::no_grad(|| kl.sum(Kind::Float).double_value(&[]));
    Ok((per_term + kl * cfg.beta, sum))
}

/// The terms summed under the averaging's weights: one weight for all, or one per term.
fn weigh_terms(per_term: Tensor, weights: TermWeights, device: Device) -> Result<Tensor, ModelError> {
    Ok(match weights {
        TermWeights::Uniform(w) => per_term.sum(Kind::Float) * w,
        TermWeights::PerTerm(ref w) => {
            let m = per_term.size()[0] as usize;
            if w.len() != m {
                return Err(ModelError::Input(format!(
                    "{} term weights for a row of {m} loss terms",
                    w.len()
                )));
            }
            (per_term * device.from_slice(w.as_slice())?).sum(Kind::Float)
        }
    })
}

/// The shares of terms clipped (in the region, below, above) and the k3 sum of KL(old ||
/// policy), outside the graph; zeros for a row without terms.
fn clip_statistics(
    ratio: &Tensor,
    adv: &Tensor,
    old: &Tensor,
    logprobs: &Tensor,
    cfg: &GrpoObjective,
) -> ([f64; 3], f64) {
    if logprobs.numel() == 0 {
        return ([0.0; 3], 0.0);
    }
    tch::no_grad(|| {
        let high = ratio.gt(1.0 + cfg.epsilon_high).logical_and(&adv.gt(0.0));
        let low = ratio.lt(1.0 - cfg.epsilon_low).logical_and(&adv.lt(0.0));
        let share = |t: &Tensor| t.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        let clips = [share(&high.logical_or(&low)), share(&low), share(&high)];
        // Sampled from the old weights: k3 of KL(old || policy) uses ratio policy/old.
        (clips, k3(old, logprobs).sum(Kind::Float).double_value(&[]))
    })
}
