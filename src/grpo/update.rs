//! The policy update: the step's rollouts packed into rows (prefix trees or flat), one
//! forward/backward per row, the loss normalised over every loss term of the step.

use std::time::Instant;

use super::{GrpoError, LossType, UpdatePacking};
use crate::model::CausalLm;
use crate::pack::{
    GrpoLossConfig, PackedRow, Rollout, TermWeights, grpo_loss_with_reference, pack_flat, plan, row_logprobs_at,
};

/// Packs `rollouts` into rows of at most `budget` tokens.
///
/// Tree: the token-budget planner (budget on unique tokens; a group's rollouts share a row
/// while they fit), each row a prefix tree. Flat: rollouts in order, end to end, a new row
/// when the next one would exceed the budget. Both emit every rollout's loss terms once.
pub fn pack_rollouts(
    rollouts: Vec<Rollout>,
    packing: UpdatePacking,
    budget: usize,
) -> Result<Vec<PackedRow>, GrpoError> {
    match packing {
        UpdatePacking::Tree => Ok(plan(rollouts, budget, 1)?.rows().map(|t| t.pack()).collect()),
        UpdatePacking::Flat => {
            let mut rows: Vec<Vec<Rollout>> = Vec::new();
            let mut used = 0;
            for (i, r) in rollouts.into_iter().enumerate() {
                r.validate(i)?;
                let n = r.input_ids.len();
                if n > budget {
                    return Err(crate::pack::PackError::OverBudget {
                        row: i,
                        tokens: n,
                        trained: r.trained(),
                        budget,
                    }
                    .into());
                }
                match rows.last_mut() {
                    Some(row) if used + n <= budget => row.push(r),
                    _ => {
                        rows.push(vec![r]);
                        used = 0;
                    }
                }
                used += n;
            }
            rows.iter().map(|r| pack_flat(r).map_err(GrpoError::from)).collect()
        }
    }
}

/// What one update's forward/backward passes measured.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UpdateStats {
    /// The step's loss (sum over rows of the normalised row losses).
    pub loss: f64,
    /// Loss terms (trained tokens over all rollouts).
    pub terms: usize,
    /// Packed rows forwarded.
    pub rows: usize,
    /// Tokens forwarded.
    pub forwarded_tokens: usize,
    /// Tokens a flat packing forwards (prompt + completion of every rollout).
    pub raw_tokens: usize,
    /// Share of terms in the clip region.
    pub clip_ratio: f64,
    /// Mean `k3(old, policy)` per term: drift since generation.
    pub approx_kl: f64,
    /// Mean `k3(reference, policy)` per term (0 without a reference).
    pub ref_kl: f64,
    /// Mean policy entropy per term (nats).
    pub entropy: f64,
    /// Seconds in forward + backward.
    pub forward_backward_s: f64,
}

impl UpdateStats {
    /// Raw tokens / forwarded tokens.
    pub fn packing_ratio(&self) -> f64 {
        self.raw_tokens as f64 / self.forwarded_tokens.max(1) as f64
    }
}

/// Runs forward and backward over every row, accumulating gradients in `policy`'s variables
/// (not zeroed here; under `tch::no_grad` only the loss and statistics are computed). With `reference` and `cfg.beta > 0`, adds the KL penalty to the
/// reference's log-probs. Each row's loss is divided by the step's total number of loss terms
/// ([`LossType::Dapo`]), so the gradient is the same whatever the packing.
pub fn accumulate_gradients(
    policy: &CausalLm,
    reference: Option<&CausalLm>,
    rows: &[PackedRow],
    cfg: &GrpoLossConfig,
) -> Result<UpdateStats, GrpoError> {
    accumulate_gradients_with(policy, reference, rows, cfg, LossType::Dapo, 0)
}

/// [`accumulate_gradients`] with a choice of normalisation (`max_completion_length` is
/// Dr. GRPO's constant).
///
/// - `Dapo`: every term / all loss terms of the step (token level).
/// - `Grpo`: every term / (its rollout's terms x rollouts of the step): each rollout's mean,
///   then the mean over rollouts.
/// - `DrGrpo`: every term / (rollouts x `max_completion_length`).
pub fn accumulate_gradients_with(
    policy: &CausalLm,
    reference: Option<&CausalLm>,
    rows: &[PackedRow],
    cfg: &GrpoLossConfig,
    loss_type: LossType,
    max_completion_length: usize,
) -> Result<UpdateStats, GrpoError> {
    let start = Instant::now();
    let terms: usize = rows.iter().map(|r| r.token_index.len()).sum();
    let norm = terms.max(1) as f64;
    let rollouts: usize = rows.iter().map(|r| r.rollouts).sum::<usize>().max(1);
    let mut stats = UpdateStats {
        terms,
        rows: rows.len(),
        ..Default::default()
    };
    let mut clipped = 0.0;
    for row in rows {
        let reference_lp = match reference.filter(|_| cfg.beta > 0.0) {
            Some(m) => Some(tch::no_grad(|| row_logprobs_at(m, row, cfg.chunks, cfg.temperature))?),
            None => None,
        };
        let per_term: Vec<f32>;
        let weights = match loss_type {
            LossType::Dapo => TermWeights::Uniform(1.0 / norm),
            LossType::DrGrpo => TermWeights::Uniform(1.0 / (rollouts * max_completion_length.max(1)) as f64),
            LossType::Grpo => {
                let mut count = vec![0usize; row.rollouts];
                for &s in &row.segment_id {
                    *count.get_mut(s as usize).ok_or_else(|| {
                        GrpoError::Other(format!(
                            "packed row: segment_id {s} but the row holds {} rollouts",
                            row.rollouts
                        ))
                    })? += 1;
                }
                per_term = row
                    .segment_id
                    .iter()
                    .map(|&s| 1.0 / (count[s as usize] * rollouts) as f32)
                    .collect();
                TermWeights::PerTerm(&per_term)
            }
        };
        let out = grpo_loss_with_reference(policy, row, cfg, weights, reference_lp.as_ref())?;
        stats.loss += out.loss.double_value(&[]);
        // Under `tch::no_grad` (evaluation) there is nothing to back-propagate.
        if out.num_terms > 0 && out.loss.requires_grad() {
            out.loss
                .f_backward()
                .map_err(|e| GrpoError::Other(format!("backward: {e}")))?;
        }
        clipped += out.clip_fraction * out.num_terms as f64;
        stats.approx_kl += out.approx_kl_sum;
        stats.ref_kl += out.ref_kl_sum;
        stats.entropy += out.entropy_sum;
        stats.forwarded_tokens += row.len();
        stats.raw_tokens += row.raw_tokens;
    }
    stats.clip_ratio = clipped / norm;
    stats.approx_kl /= norm;
    stats.ref_kl /= norm;
    stats.entropy /= norm;
    stats.forward_backward_s = start.elapsed().as_secs_f64();
    Ok(stats)
}
