//! The policy update: the step's rollouts planned into packed rows (prefix trees or flat), one
//! forward/backward per row, every loss term weighted over the whole step.

use std::time::Instant;

use super::objective::GrpoObjective;
use super::routing_replay::StepRouting;
use super::row_loss::{grpo_loss_backward, row_router_loss};
use super::row_terms::TermLogprobs;
use crate::device::Device;
use crate::distributed::World;
use crate::model::{CausalLm, Pass};
use crate::pack::{PackedRow, Packing, Rollout, distinct_terms, row_logprobs_at};
use crate::train::TrainError;

/// Packs `rollouts` into rows of at most `budget` tokens through the planner (unique tokens
/// for trees: a group's rollouts share a row while they fit). Both packings emit every
/// rollout's loss terms once, so the update is the same either way.
pub fn pack_rollouts(rollouts: Vec<Rollout>, packing: Packing, budget: usize) -> Result<Vec<PackedRow>, TrainError> {
    Ok(packing.plan(rollouts, budget, 1)?.into_iter().flatten().collect())
}

/// One rank's part of a step's update: its rows (the planner spreads the step's rows over the
/// ranks by attention load) and the step's totals every loss weight divides by.
#[derive(Debug, Clone)]
pub(crate) struct RankUpdate {
    /// The rows this rank forwards.
    pub rows: Vec<PackedRow>,
    /// The whole step's totals (every rank's rows).
    pub totals: StepTotals,
    /// Rows of the whole step.
    pub step_rows: usize,
}

/// What a step's loss is normalised by: its loss terms and rollouts, over every rank.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct StepTotals {
    /// Loss terms (trained tokens).
    pub terms: usize,
    /// Rollouts.
    pub rollouts: usize,
    /// Loss terms of each rollout, by its index in the step (`PackedRow::sources`): what
    /// step-wide micro-batches (`bnpo`) are counted from.
    pub rollout_terms: Vec<usize>,
}

impl StepTotals {
    /// The totals of `rows`.
    pub(crate) fn of<'a>(rows: impl IntoIterator<Item = &'a PackedRow>) -> Self {
        let mut totals = StepTotals::default();
        for r in rows {
            totals.terms += r.token_index.len();
            totals.rollouts += r.rollouts;
            for &s in &r.segment_id {
                let Some(&source) = r.sources.get(s as usize) else {
                    continue;
                };
                if totals.rollout_terms.len() <= source {
                    totals.rollout_terms.resize(source + 1, 0);
                }
                totals.rollout_terms[source] += 1;
            }
        }
        totals
    }
}

/// Plans the step's `rollouts` (the same on every rank) over `ranks` ranks and keeps rank
/// `rank`'s rows.
pub(crate) fn plan_rank_update(
    rollouts: Vec<Rollout>,
    packing: Packing,
    budget: usize,
    rank: usize,
    ranks: usize,
) -> Result<RankUpdate, TrainError> {
    let mut plan = packing.plan(rollouts, budget, ranks)?;
    let totals = StepTotals::of(plan.iter().flatten());
    let step_rows = plan.iter().map(Vec::len).sum();
    let rows = match rank < plan.len() {
        true => plan.swap_remove(rank),
        false => Vec::new(),
    };
    Ok(RankUpdate {
        rows,
        totals,
        step_rows,
    })
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
    /// Share of terms clipped below (ratio under `1 - epsilon_low`, negative advantage).
    #[serde(default)]
    pub clip_ratio_low: f64,
    /// Share of terms clipped above (ratio over `1 + epsilon_high`, positive advantage).
    #[serde(default)]
    pub clip_ratio_high: f64,
    /// Mean `k3(old, policy)` per term: drift since generation.
    pub approx_kl: f64,
    /// Mean `k3(reference, policy)` per term (0 without a reference).
    pub ref_kl: f64,
    /// Mean policy entropy per term (nats).
    pub entropy: f64,
    /// Mean policy entropy over the trained terms (those at or above the entropy floor; all
    /// without `top_entropy_quantile`): what the entropy bonus and its controller use.
    #[serde(default)]
    pub entropy_trained: f64,
    /// Mean sampling-correction weight per term (1 without the correction; below 1 when
    /// masked or truncated rollouts lag).
    #[serde(default)]
    pub sampling_correction: f64,
    /// A mixture model's load-balancing loss, each row's weighted by its share of the step's
    /// rollouts (0 for a dense model).
    #[serde(default)]
    pub aux_loss: f64,
    /// (Trained token, sparse layer) pairs whose experts differed from the generator's.
    #[serde(default)]
    pub routing_mismatched: f64,
    /// Such pairs compared (those with recorded routing).
    #[serde(default)]
    pub routing_compared: f64,
    /// Seconds in forward + backward.
    pub forward_backward_s: f64,
}

impl UpdateStats {
    /// Raw tokens / forwarded tokens.
    pub fn packing_ratio(&self) -> f64 {
        self.raw_tokens as f64 / self.forwarded_tokens.max(1) as f64
    }

    /// Every rank's statistics summed: each rank's are its share of the step's means, as
    /// [`accumulate_share`] divides by the step's totals. Timings stay this rank's; a new
    /// statistic that ranks share joins the list in [`UpdateStats::shared_by_ranks`].
    pub(crate) fn sum_over_ranks(&mut self, world: &World) -> Result<(), TrainError> {
        if !world.is_distributed() {
            return Ok(());
        }
        let (means, counts) = self.shared_by_ranks();
        let mut values: Vec<f64> = means
            .iter()
            .map(|v| **v)
            .chain(counts.iter().map(|c| **c as f64))
            .collect();
        world.sum(&mut values)?;
        let (means, counts) = self.shared_by_ranks();
        let (summed_means, summed_counts) = values.split_at(means.len());
        for (field, v) in means.into_iter().zip(summed_means) {
            *field = *v;
        }
        for (field, v) in counts.into_iter().zip(summed_counts) {
            *field = *v as usize;
        }
        Ok(())
    }

    /// The statistics every rank holds a share of: means (shares of the step's) and counts.
    fn shared_by_ranks(&mut self) -> ([&mut f64; 12], [&mut usize; 3]) {
        let UpdateStats {
            loss,
            terms: _,
            rows,
            forwarded_tokens,
            raw_tokens,
            clip_ratio,
            clip_ratio_low,
            clip_ratio_high,
            approx_kl,
            ref_kl,
            entropy,
            entropy_trained,
            sampling_correction,
            aux_loss,
            routing_mismatched,
            routing_compared,
            forward_backward_s: _,
        } = self;
        (
            [
                loss,
                clip_ratio,
                clip_ratio_low,
                clip_ratio_high,
                approx_kl,
                ref_kl,
                entropy,
                entropy_trained,
                sampling_correction,
                aux_loss,
                routing_mismatched,
                routing_compared,
            ],
            [forwarded_tokens, raw_tokens, rows],
        )
    }
}

/// Runs forward and backward over every row, accumulating gradients in `policy`'s variables
/// (not zeroed here; under `tch::no_grad` only the loss and statistics are computed). With
/// `reference` and `objective.beta > 0`, adds the KL penalty to the reference's log-probs. The
/// loss terms are weighted over every row of the step (`GrpoObjective::term_weights`), so the
/// gradient is the same whatever the packing.
pub fn accumulate_gradients(
    policy: &CausalLm,
    reference: Option<&CausalLm>,
    rows: &[PackedRow],
    objective: &GrpoObjective,
) -> Result<UpdateStats, TrainError> {
    let objective = match objective.entropy_floor {
        Some(_) => *objective,
        None => floored(&term_entropies(policy, rows, objective)?, *objective),
    };
    let routing = StepRouting::default();
    accumulate_share(policy, reference, rows, StepTotals::of(rows), (&objective, &routing))
}

/// `objective` with the step's entropy floor set from every rank's rows when
/// `top_entropy_quantile < 1` (one extra forward per row, without gradient): the quantile is
/// over the whole step, so it is the same in either packing and on any number of ranks.
/// `idle`: passes this rank makes without rows, so that a sharded model's gathers meet the
/// other ranks' ([`idle_rows`]).
pub(crate) fn with_entropy_floor(
    policy: &CausalLm,
    (rows, idle): (&[PackedRow], usize),
    objective: GrpoObjective,
    world: &World,
) -> Result<GrpoObjective, TrainError> {
    if objective.top_entropy_quantile >= 1.0 {
        return Ok(objective);
    }
    let local = term_entropies(policy, rows, &objective)?;
    for _ in 0..idle {
        policy.idle_pass(Pass::Forward)?;
    }
    let bytes: Vec<u8> = local.iter().flat_map(|e| e.to_le_bytes()).collect();
    let all: Vec<f32> = world
        .all_gather_bytes(&bytes)?
        .iter()
        .flat_map(|b| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    Ok(floored(&all, objective))
}

/// How many rows fewer than the busiest rank this one has, when the policy runs in lockstep
/// (`full_shard`: each pass gathers every layer from every rank; `no_shard` across processes:
/// the last pass reduces the gradients; so every rank makes as many passes); 0 otherwise,
/// without a collective.
pub(crate) fn idle_rows(policy: &CausalLm, rows: usize, world: &World) -> Result<usize, TrainError> {
    if !policy.in_lockstep() {
        return Ok(0);
    }
    let mut counts = vec![0.0; world.size];
    counts[world.rank] = rows as f64;
    world.sum(&mut counts)?;
    let most = counts.iter().fold(0.0f64, |a, &b| a.max(b)) as usize;
    Ok(most - rows)
}

/// The passes [`accumulate_share`] makes for a row, made `idle` times without one: the
/// policy's log-probs before the update (with a sampling correction) and the loss's forward
/// and backward.
pub(crate) fn idle_share(policy: &CausalLm, idle: usize, objective: &GrpoObjective) -> Result<(), TrainError> {
    for _ in 0..idle {
        if objective.sampling_correction.is_some() {
            policy.idle_pass(Pass::Forward)?;
        }
        policy.idle_pass(Pass::ForwardBackward)?;
    }
    Ok(())
}

/// `objective` with the floor of the step's `entropies` ([`entropy_floor`]) and the count of
/// terms at or above it, which the entropy bonus averages over.
fn floored(entropies: &[f32], objective: GrpoObjective) -> GrpoObjective {
    let floor = entropy_floor(entropies, &objective);
    GrpoObjective {
        entropy_floor: floor,
        entropy_terms: floor.map(|f| entropies.iter().filter(|&&e| f64::from(e) >= f).count()),
        ..objective
    }
}

/// Every loss term's policy entropy in `rows` (nats, under the sampling temperature; no
/// gradient): what `top_entropy_quantile` ranks. Empty unless `top_entropy_quantile < 1`.
fn term_entropies(policy: &CausalLm, rows: &[PackedRow], objective: &GrpoObjective) -> Result<Vec<f32>, TrainError> {
    let mut out = Vec::new();
    if objective.top_entropy_quantile >= 1.0 {
        return Ok(out);
    }
    for row in rows {
        let terms = tch::no_grad(|| distinct_terms(policy, row, objective.temperature))?;
        let (_, per_pair) =
            tch::no_grad(|| terms.logprobs_and_entropies(policy.head(), objective.chunks, &objective.truncation))?;
        let per_term = per_pair
            .f_index_select(0, &terms.of_term)
            .and_then(|t| Device::to_host(&t))
            .map_err(crate::model::ModelError::from)?;
        out.extend(Vec::<f32>::try_from(&per_term).map_err(crate::model::ModelError::from)?);
    }
    Ok(out)
}

/// The entropy at quantile `1 - top_entropy_quantile` of `entropies` (`torch.quantile`'s
/// linear interpolation, as TRL takes it): terms at or above it train. `None` when every term
/// trains.
fn entropy_floor(entropies: &[f32], objective: &GrpoObjective) -> Option<f64> {
    let q = objective.top_entropy_quantile;
    if q >= 1.0 || entropies.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = entropies.iter().map(|&e| f64::from(e)).collect();
    v.sort_by(f64::total_cmp);
    let at = (1.0 - q).clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    Some(v[lo] + (v[hi] - v[lo]) * (at - lo as f64))
}

/// [`accumulate_gradients`] over one rank's `rows` of a step whose totals are `totals`: the
/// loss weights and the statistics divide by the whole step's counts, so summing every rank's
/// gradients and statistics gives the one-process update.
pub(crate) fn accumulate_share(
    policy: &CausalLm,
    reference: Option<&CausalLm>,
    rows: &[PackedRow],
    totals: StepTotals,
    (objective, routing): (&GrpoObjective, &StepRouting<'_>),
) -> Result<UpdateStats, TrainError> {
    let start = Instant::now();
    let StepTotals { terms, .. } = totals;
    let norm = terms.max(1) as f64;
    // The entropy bonus averages over the whole step's trained terms.
    let trained = objective.entropy_terms.unwrap_or(terms);
    let objective = &GrpoObjective {
        entropy_terms: Some(trained),
        ..*objective
    };
    let mut stats = UpdateStats {
        terms,
        rows: rows.len(),
        ..Default::default()
    };
    let mut clipped = [0.0; 3];
    for row in rows {
        let (chunks, temperature, truncation) = (objective.chunks, objective.temperature, &objective.truncation);
        let logprobs_of = |m: &CausalLm| tch::no_grad(|| row_logprobs_at(m, row, chunks, temperature, truncation));
        let reference_lp = reference
            .filter(|_| objective.beta > 0.0)
            .map(logprobs_of)
            .transpose()?;
        // The policy before this update: no row's backward has changed the weights yet.
        let before_lp = objective.sampling_correction.map(|_| logprobs_of(policy)).transpose()?;
        let weights = objective.term_weights(row, &totals)?;
        let other = TermLogprobs {
            reference: reference_lp.as_ref(),
            before_update: before_lp.as_ref(),
        };
        // Under `tch::no_grad` (evaluation) nothing is back-propagated.
        let router = row_router_loss(row, objective.router_aux_loss_coef, totals.rollouts);
        let recorded = routing.of_row(policy, row)?;
        let out = grpo_loss_backward(
            policy,
            row,
            objective,
            (weights, other),
            (router.as_ref(), recorded.as_ref()),
        )?;
        if let Some(r) = &recorded {
            let (mismatched, compared) = r.mismatch();
            stats.routing_mismatched += mismatched;
            stats.routing_compared += compared;
        }
        if let Some(aux) = out.aux_loss {
            stats.aux_loss += aux * row.rollouts as f64 / totals.rollouts.max(1) as f64;
        }
        stats.sampling_correction += out.correction_sum;
        stats.loss += out.loss.double_value(&[]);
        let n = out.num_terms as f64;
        clipped[0] += out.clip_fraction * n;
        clipped[1] += out.clip_low_fraction * n;
        clipped[2] += out.clip_high_fraction * n;
        stats.approx_kl += out.approx_kl_sum;
        stats.ref_kl += out.ref_kl_sum;
        stats.entropy += out.entropy_sum;
        stats.entropy_trained += out.kept_entropy_sum;
        stats.forwarded_tokens += row.len();
        stats.raw_tokens += row.raw_tokens;
    }
    stats.sampling_correction /= norm;
    stats.clip_ratio = clipped[0] / norm;
    stats.clip_ratio_low = clipped[1] / norm;
    stats.clip_ratio_high = clipped[2] / norm;
    stats.approx_kl /= norm;
    stats.ref_kl /= norm;
    stats.entropy /= norm;
    stats.entropy_trained /= trained.max(1) as f64;
    stats.forward_backward_s = start.elapsed().as_secs_f64();
    Ok(stats)
}
