//! The per-term pieces of the GRPO objective over a packed row's loss terms `[M]`: each loss
//! type's policy term, the importance ratio (per token, or per rollout for GSPO), the sampling
//! correction's weights and the off-policy mask. Pieces taken per rollout sum or average over
//! the rollout's own terms, which never straddle rows, so tree and flat rows agree.

use tch::{Kind, Tensor};

use super::config::{ImportanceSampling, LossType, SamplingCorrectionMode};
use super::objective::{GrpoObjective, SamplingCorrection};
use crate::device::Device;
use crate::model::ModelError;
use crate::pack::PackedRow;

/// Every term's policy loss `[M]` under `cfg.loss_type`, before masks, correction and KL.
pub(super) fn policy_terms(
    row: &PackedRow,
    logprobs: &Tensor,
    old: &Tensor,
    ratio: &Tensor,
    adv: &Tensor,
    correction: Option<&Tensor>,
    cfg: &GrpoObjective,
) -> Result<Tensor, ModelError> {
    Ok(match cfg.loss_type {
        LossType::Cispo => {
            let weight = ratio.f_clamp_max(cfg.epsilon_high)?.f_detach()?;
            weight.f_mul(adv)?.f_mul(logprobs)?.f_neg()?
        }
        LossType::Sapo => {
            let [pos, neg] = cfg.sapo_temperatures;
            let tau = adv
                .f_gt(0.0)?
                .f_to_kind(Kind::Float)?
                .f_mul_scalar(pos - neg)?
                .f_add_scalar(neg)?;
            let gate = tau
                .f_mul(&ratio.f_sub_scalar(1.0)?)?
                .f_sigmoid()?
                .f_mul_scalar(4.0)?
                .f_div(&tau)?;
            gate.f_mul(adv)?.f_neg()?
        }
        LossType::Vespo => {
            let phi = vespo_weights(row, logprobs, old, adv, correction, cfg)?;
            phi.f_mul(adv)?.f_mul(logprobs)?.f_neg()?
        }
        LossType::Dapo | LossType::Grpo | LossType::DrGrpo | LossType::Bnpo | LossType::Luspo => {
            clipped_surrogate(ratio, adv, cfg)
        }
    })
}

/// VESPO's detached Gamma weight of every term's rollout `[M]`: `w` = exp of the rollout's
/// summed log-ratio (each token's clamped to [-20, 20]; plus the log of the sampling
/// correction, when on), clamped to [1e-8, e^20]; then `exp(lambda + k ln w - lambda w)`, with
/// `(k, lambda)` by the advantage's sign and `lambda >= 1e-4`; NaN or infinite weights 0.
fn vespo_weights(
    row: &PackedRow,
    logprobs: &Tensor,
    old: &Tensor,
    adv: &Tensor,
    correction: Option<&Tensor>,
    cfg: &GrpoObjective,
) -> Result<Tensor, tch::TchError> {
    let floor = 1e-8f64.ln();
    tch::no_grad(|| {
        let log_ratio = logprobs.f_detach()?.f_sub(old)?.f_clamp(-20.0, 20.0)?;
        let mut log_w = per_rollout(row, &log_ratio, Reduce::Sum)?;
        if let Some(w) = correction {
            log_w = log_w.f_add(&per_rollout(row, &w.f_log()?.f_clamp(floor, 20.0)?, Reduce::Sum)?)?;
        }
        let log_w = log_w.f_clamp(floor, 20.0)?;
        let [(k_pos, l_pos), (k_neg, l_neg)] = cfg.vespo_shape;
        let nonneg = adv.f_ge(0.0)?.f_to_kind(Kind::Float)?;
        let k = nonneg.f_mul_scalar(k_pos - k_neg)?.f_add_scalar(k_neg)?;
        let lambda = nonneg
            .f_mul_scalar(l_pos - l_neg)?
            .f_add_scalar(l_neg)?
            .f_clamp_min(1e-4)?;
        let log_phi = lambda
            .f_add(&k.f_mul(&log_w)?)?
            .f_sub(&lambda.f_mul(&log_w.f_exp()?)?)?;
        log_phi.f_exp()?.f_nan_to_num(0.0, 0.0, 0.0)
    })
}

/// DeepSeek-V3.2's off-policy sequence mask `[M]` (1 keeps the term): a term stays when its
/// rollout's advantage is >= 0 or the rollout's mean of `sampled - policy` log-prob (the KL
/// from the sampling weights, NaN counted 0) is at most `threshold`.
pub(super) fn off_policy_mask(
    row: &PackedRow,
    logprobs: &Tensor,
    adv: &Tensor,
    threshold: f64,
) -> Result<Tensor, tch::TchError> {
    let device = Device::of(logprobs);
    tch::no_grad(|| {
        let sampled = device.from_slice(&row.old_log_probs)?;
        let kl = sampled.f_sub(&logprobs.f_detach()?)?.f_nan_to_num(0.0, None, None)?;
        let mean = per_rollout(row, &kl, Reduce::Mean)?;
        adv.f_ge(0.0)?
            .f_logical_or(&mean.f_le(threshold)?)?
            .f_to_kind(Kind::Float)
    })
}

/// `-min(unclipped ratio x adv, clipped ratio x adv)` per term; `delta` caps the unclipped
/// ratio too (two-sided clipping).
fn clipped_surrogate(ratio: &Tensor, adv: &Tensor, cfg: &GrpoObjective) -> Tensor {
    let clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high);
    let unclipped = match cfg.delta {
        Some(delta) => ratio.clamp_max(delta),
        None => ratio.shallow_clone(),
    };
    -(&unclipped * adv).minimum(&(&clipped * adv))
}

/// TRL's importance-sampling correction weight of every term `[M]`: `exp(before - sampled)`
/// per token, or of its rollout's sum, then clipped (`*_truncate`) or zeroed outside the bounds
/// (`*_mask`).
pub(super) fn sampling_weights(
    row: &PackedRow,
    before: &Tensor,
    sampled: &Tensor,
    c: SamplingCorrection,
) -> Result<Tensor, tch::TchError> {
    use SamplingCorrectionMode::*;
    let diff = before.f_sub(sampled)?;
    let log_w = match c.mode {
        TokenTruncate | TokenMask => diff,
        SequenceTruncate | SequenceMask => per_rollout(row, &diff, Reduce::Sum)?,
    };
    let w = log_w.f_exp()?;
    match c.mode {
        TokenTruncate | SequenceTruncate => w.f_clamp(c.clip_min.unwrap_or(0.0), c.clip_max.unwrap_or(f64::INFINITY)),
        TokenMask | SequenceMask => {
            let inside = w
                .f_ge(c.clip_min.unwrap_or(f64::NEG_INFINITY))?
                .f_logical_and(&w.f_le(c.clip_max.unwrap_or(f64::INFINITY))?)?;
            w.f_mul(&inside.f_to_kind(Kind::Float)?)
        }
    }
}

/// How [`per_rollout`] combines a rollout's terms.
#[derive(Clone, Copy, PartialEq)]
enum Reduce {
    Sum,
    Mean,
}

/// `values` `[M]` summed (or averaged) over each term's rollout and handed back to every term
/// of it `[M]`. Rollouts never straddle rows, so this is the whole completion in either packing.
fn per_rollout(row: &PackedRow, values: &Tensor, reduce: Reduce) -> Result<Tensor, tch::TchError> {
    let device = crate::device::Device::of(values);
    let rollout = device.from_slice(&row.segment_id)?;
    let n = row.rollouts as i64;
    let mut totals = device.zeros(&[n], values.kind())?.f_index_add(0, &rollout, values)?;
    if reduce == Reduce::Mean {
        let counts = device
            .zeros(&[n], values.kind())?
            .f_index_add(0, &rollout, &values.f_ones_like()?)?
            .f_clamp_min(1.0)?;
        totals = totals.f_div(&counts)?;
    }
    totals.f_index_select(0, &rollout)
}

/// Every term's importance ratio `[M]`: `exp(logp - old)` per token, or (sequence level, GSPO)
/// `exp` of the mean log-ratio over the term's rollout, the same for all its terms.
pub(super) fn importance_ratio(
    row: &PackedRow,
    logprobs: &Tensor,
    old: &Tensor,
    level: ImportanceSampling,
) -> Result<Tensor, tch::TchError> {
    let log_ratio = logprobs.f_sub(old)?;
    match level {
        ImportanceSampling::Token => log_ratio.f_exp(),
        ImportanceSampling::Sequence => per_rollout(row, &log_ratio, Reduce::Mean)?.f_exp(),
    }
}
