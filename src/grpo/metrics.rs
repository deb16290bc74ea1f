//! What a GRPO step reports. [`GrpoStepMetrics`] nests one group per concern, each made where
//! it is known: the batch's origin ([`BatchOrigin`]), what it held ([`RolloutMetrics`], from the
//! batch), the update ([`UpdateMetrics`], from [`UpdateStats`] summed over ranks with the
//! optimizer's [`StepOutcome`]), the times ([`StepTimes`], from the batch, the update and the
//! step's own clock) and the multi-turn drift ([`TurnDrift`]). The groups are flattened, so
//! `log.jsonl`'s keys, TensorBoard's tags and `metrics.csv`'s columns are one flat list, in
//! order. Every field is written once; none starts as a placeholder.

use super::advantage::mean_std;
use super::reward::RewardFn;
use super::rollouts::{DriftTally, RolloutBatch};
use super::update::UpdateStats;
use crate::generate::FinishReason;
use crate::train::StepOutcome;

/// Mean and spread of one reward function over a step's rollouts.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RewardStat {
    /// Function name.
    pub name: String,
    /// Mean over scored rollouts.
    pub mean: f64,
    /// Standard deviation over scored rollouts.
    pub std: f64,
}

impl RewardStat {
    /// The mean of the function called `name` among `stats` (a step's or an evaluation's).
    pub(crate) fn mean_in(stats: &[RewardStat], name: &str) -> Option<f64> {
        stats.iter().find(|r| r.name == name).map(|r| r.mean)
    }
}

/// Metrics of one GRPO step, grouped by where they come from. Each group is flattened: a
/// `log.jsonl` line (and TensorBoard, `metrics.csv`) holds every metric at the top level, in the
/// groups' order (`step`, `generated_by`, ..., `reward_mean`, ..., `loss`, ..., `step_s`, ...).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GrpoStepMetrics {
    /// Step number (1-based).
    pub step: u64,
    /// The weights that generated the batch, and how stale it was.
    #[serde(flatten)]
    pub origin: BatchOrigin,
    /// What the batch held: rewards and completion lengths.
    #[serde(flatten)]
    pub rollouts: RolloutMetrics,
    /// What the update measured: the loss and its terms, the gradient, the packing.
    #[serde(flatten)]
    pub update: UpdateMetrics,
    /// Where the step's time went, and the throughputs.
    #[serde(flatten)]
    pub times: StepTimes,
    /// Whether the update was skipped (non-finite loss or gradient norm: the weights are left
    /// untouched, the step counts in `skipped_steps`).
    pub skipped: bool,
    /// Multi-turn: how re-rendered histories departed from what the model saw.
    #[serde(flatten)]
    pub turns: TurnDrift,
    /// Tool use, summed over ranks (a [`super::ToolEnvironment`]'s run; empty otherwise):
    /// `call_frequency` (calls per conversation), `failure_frequency` (failures per call), then
    /// `<tool>/call_frequency` and `<tool>/failure_frequency`, logged as `tools/...` (TRL's
    /// names).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub tools: std::collections::BTreeMap<String, f64>,
}

/// Where a step's batch came from ([`GrpoStepMetrics::origin`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BatchOrigin {
    /// Weight version that generated the batch (its oldest group).
    pub generated_by: u64,
    /// Steps between generation and this update (of the oldest group).
    pub staleness: u64,
    /// Groups dropped as too stale while this step's batch was assembled.
    pub dropped_stale: usize,
}

/// The batch's side of a step's metrics: rewards and completion lengths
/// ([`GrpoStepMetrics::rollouts`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RolloutMetrics {
    /// Mean total (weighted) reward.
    pub reward_mean: f64,
    /// Spread of the total reward.
    pub reward_std: f64,
    /// Per reward function.
    pub rewards: Vec<RewardStat>,
    /// Rollouts some reward function failed on (advantage 0).
    pub reward_failures: usize,
    /// Mean completion length: tokens the model generated (multi-turn: over all its turns,
    /// the environment's messages not counted).
    pub completion_length: f64,
    /// Longest completion.
    pub completion_length_max: usize,
    /// Shortest completion.
    #[serde(default)]
    pub completion_length_min: usize,
    /// Share of groups whose rewards were all equal: zero advantages, no gradient (TRL's
    /// `frac_reward_zero_std`).
    #[serde(default)]
    pub frac_reward_zero_std: f64,
    /// Share of completions cut at `max_completion_length`.
    pub truncated_ratio: f64,
}

/// The update's side: its statistics summed over ranks, what the optimizer step did, and the
/// rows of the step ([`GrpoStepMetrics::update`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UpdateMetrics {
    /// The loss.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Share of loss terms in the clip region (`clip_ratio/region_mean`).
    pub clip_ratio: f64,
    /// Share clipped below: ratio under `1 - epsilon_low` with a negative advantage.
    #[serde(default)]
    pub clip_ratio_low: f64,
    /// Share clipped above: ratio over `1 + epsilon_high` with a positive advantage.
    #[serde(default)]
    pub clip_ratio_high: f64,
    /// Mean `k3(generator, policy)` per term.
    pub approx_kl: f64,
    /// Mean `k3(reference, policy)` per term (0 when `beta = 0`).
    pub kl: f64,
    /// Mean policy entropy per term.
    pub entropy: f64,
    /// The entropy bonus's coefficient this step (0: off, or held back by the adaptive
    /// controller).
    #[serde(default)]
    pub entropy_coef: f64,
    /// Mean sampling-correction weight per term (1 without `importance_sampling_correction`).
    #[serde(default)]
    pub sampling_correction: f64,
    /// Raw tokens / forwarded tokens of the update.
    pub packing_ratio: f64,
    /// Tokens forwarded by the update (unique tokens for trees).
    pub forwarded_tokens: usize,
    /// Prompt + completion tokens of every rollout.
    pub raw_tokens: usize,
    /// Packed rows.
    pub rows: usize,
    /// A mixture model's load-balancing loss (`train/aux_loss`; its `router_aux_loss_coef`
    /// multiple is in the gradient, not in `loss`). `None` for a dense model or with
    /// `router_aux_loss_coef = 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// A mixture model's share of (trained token, sparse layer) pairs whose experts in the
    /// update differ as a set from those the generator chose (`train/routing_mismatch`): 0
    /// under `routing_replay`. `None` for a dense model or rollouts without recorded routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_mismatch: Option<f64>,
}

/// Where a step's wall time went, and the throughputs ([`GrpoStepMetrics::times`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepTimes {
    /// Seconds generating this batch (on the generation thread in async mode).
    pub generation_s: f64,
    /// Seconds the trainer waited for a batch (async).
    pub wait_s: f64,
    /// Seconds scoring.
    pub reward_s: f64,
    /// Seconds packing.
    pub pack_s: f64,
    /// Seconds in forward + backward.
    pub forward_backward_s: f64,
    /// Seconds in clipping and the optimizer step.
    pub optimizer_s: f64,
    /// Wall seconds of the whole step (as the trainer saw it).
    pub step_s: f64,
    /// Generated tokens per second of generation.
    pub generation_tokens_per_s: f64,
    /// Raw (rollout) tokens per second of forward + backward.
    pub training_tokens_per_s: f64,
}

/// Multi-turn drift of a step's conversations: how their re-rendered histories departed from
/// what the model saw ([`GrpoStepMetrics::turns`]; all 0 for single-turn runs).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TurnDrift {
    /// Share of turn transitions whose re-rendered history was realigned as context
    /// (`fork_threshold_tokens`).
    pub realign_frac: f64,
    /// Share of turn transitions that forked a new row.
    pub fork_frac: f64,
    /// Held tokens a transition's departure moved, on average.
    pub drift_tokens_mean: f64,
    /// The most any transition moved.
    pub drift_tokens_max: usize,
}

/// TensorBoard and CSV tags: TRL's `GRPOTrainer` metric names where it logs the same quantity
/// (`train/reward`, `train/completions/mean_length`, `train/clip_ratio/region_mean`, ...),
/// treetrain's own elsewhere.
impl crate::train::Scalars for GrpoStepMetrics {
    const SECTION: &'static str = "train";
    const RENAMES: &'static [(&'static str, &'static str)] = &[
        ("reward_mean", "reward"),
        ("lr", "learning_rate"),
        ("completion_length", "completions/mean_length"),
        ("completion_length_max", "completions/max_length"),
        ("completion_length_min", "completions/min_length"),
        ("truncated_ratio", "completions/clipped_ratio"),
        ("clip_ratio", "clip_ratio/region_mean"),
        ("clip_ratio_low", "clip_ratio/low_mean"),
        ("clip_ratio_high", "clip_ratio/high_mean"),
        ("sampling_correction", "sampling/importance_sampling_ratio/mean"),
        ("realign_frac", "rollout/realign_frac"),
        ("fork_frac", "rollout/fork_frac"),
        ("drift_tokens_mean", "rollout/drift_tokens_mean"),
        ("drift_tokens_max", "rollout/drift_tokens_max"),
    ];
    fn step(&self) -> u64 {
        self.step
    }
}

/// One completion kept for the display.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampleCompletion {
    /// Step that trained on it.
    pub step: u64,
    /// Dataset row of the prompt.
    pub dataset_row: usize,
    /// The prompt: the last message of a conversation, else the prompt text.
    pub prompt: String,
    /// The completion text.
    pub completion: String,
    /// Per reward function (None: failed).
    pub rewards: Vec<Option<f32>>,
    /// Weighted total.
    pub total: Option<f32>,
    /// Its advantage.
    pub advantage: f32,
}

impl RolloutMetrics {
    /// What `batch`, scored by `rewards`, says before any update.
    pub(crate) fn of(batch: &RolloutBatch, rewards: &[RewardFn]) -> Self {
        let totals: Vec<f64> = batch.totals().flatten().map(f64::from).collect();
        let (reward_mean, reward_std) = mean_std(&totals);
        let lengths: Vec<usize> = batch
            .groups
            .iter()
            .flat_map(|g| (0..g.completions.len()).map(|i| g.generated_tokens(i)))
            .collect();
        let n = lengths.len().max(1) as f64;
        let truncated = batch
            .groups
            .iter()
            .flat_map(|g| &g.completions)
            .filter(|c| c.finish_reason == FinishReason::Length)
            .count();
        RolloutMetrics {
            reward_mean,
            reward_std,
            rewards: reward_stats(batch, rewards),
            reward_failures: batch.totals().filter(Option::is_none).count(),
            completion_length: lengths.iter().sum::<usize>() as f64 / n,
            completion_length_max: lengths.iter().copied().max().unwrap_or(0),
            completion_length_min: lengths.iter().copied().min().unwrap_or(0),
            frac_reward_zero_std: batch.frac_reward_zero_std(),
            truncated_ratio: truncated as f64 / n,
        }
    }
}

impl UpdateMetrics {
    /// The update's statistics (summed over ranks) with what the optimizer step did, the
    /// entropy bonus's coefficient and the step's packed rows.
    pub(crate) fn of(stats: &UpdateStats, outcome: &StepOutcome, entropy_coef: f64, rows: usize, routed: bool) -> Self {
        UpdateMetrics {
            loss: stats.loss,
            grad_norm: outcome.grad_norm,
            lr: outcome.lr,
            clip_ratio: stats.clip_ratio,
            clip_ratio_low: stats.clip_ratio_low,
            clip_ratio_high: stats.clip_ratio_high,
            approx_kl: stats.approx_kl,
            kl: stats.ref_kl,
            entropy: stats.entropy,
            entropy_coef,
            sampling_correction: stats.sampling_correction,
            packing_ratio: stats.packing_ratio(),
            forwarded_tokens: stats.forwarded_tokens,
            raw_tokens: stats.raw_tokens,
            rows,
            aux_loss: routed.then_some(stats.aux_loss),
            routing_mismatch: (stats.routing_compared > 0.0).then(|| stats.routing_mismatched / stats.routing_compared),
        }
    }
}

impl TurnDrift {
    /// The shares and means of a step's tallied transitions.
    pub(crate) fn of(drift: &DriftTally) -> Self {
        TurnDrift {
            realign_frac: share(drift.realigned, drift.transitions),
            fork_frac: share(drift.forked, drift.transitions),
            drift_tokens_mean: share(drift.drift_tokens, drift.transitions),
            drift_tokens_max: drift.drift_max,
        }
    }
}

/// The update's part of a step: its metrics, whether the optimizer skipped it, and its times.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct UpdatePart {
    pub(crate) metrics: UpdateMetrics,
    pub(crate) skipped: bool,
    pub(crate) pack_s: f64,
    pub(crate) forward_backward_s: f64,
    pub(crate) optimizer_s: f64,
}

/// What the step itself measured: how stale its batch was, and its waiting and wall time.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct StepClock {
    pub(crate) staleness: u64,
    pub(crate) dropped_stale: usize,
    pub(crate) wait_s: f64,
    pub(crate) step_s: f64,
}

impl GrpoStepMetrics {
    /// Step `step`'s metrics: the batch's groups from `batch` scored by `rewards`, the update's
    /// from `update`, and the times from all three.
    pub(crate) fn compose(
        step: u64,
        (batch, rewards): (&RolloutBatch, &[RewardFn]),
        update: UpdatePart,
        clock: StepClock,
    ) -> Self {
        let raw_tokens = update.metrics.raw_tokens;
        GrpoStepMetrics {
            step,
            origin: BatchOrigin {
                generated_by: batch.version,
                staleness: clock.staleness,
                dropped_stale: clock.dropped_stale,
            },
            rollouts: RolloutMetrics::of(batch, rewards),
            update: update.metrics,
            times: StepTimes {
                generation_s: batch.generation_s,
                wait_s: clock.wait_s,
                reward_s: batch.reward_s,
                pack_s: update.pack_s,
                forward_backward_s: update.forward_backward_s,
                optimizer_s: update.optimizer_s,
                step_s: clock.step_s,
                generation_tokens_per_s: batch.generated_tokens as f64 / batch.generation_s.max(1e-9),
                training_tokens_per_s: raw_tokens as f64 / update.forward_backward_s.max(1e-9),
            },
            skipped: update.skipped,
            turns: TurnDrift::of(&DriftTally::over(&batch.groups)),
            tools: Default::default(),
        }
    }
}

/// Mean and spread of every reward function over a batch.
pub(crate) fn reward_stats(batch: &RolloutBatch, rewards: &[RewardFn]) -> Vec<RewardStat> {
    rewards
        .iter()
        .enumerate()
        .map(|(f, r)| {
            let v: Vec<f64> = batch
                .groups
                .iter()
                .flat_map(|g| g.rewards.per_function[f].iter().flatten().map(|&x| f64::from(x)))
                .collect();
            let (mean, std) = mean_std(&v);
            RewardStat {
                name: r.name.clone(),
                mean,
                std,
            }
        })
        .collect()
}

/// `part / whole`, 0 when there is no whole.
fn share(part: usize, whole: usize) -> f64 {
    part as f64 / whole.max(1) as f64
}

/// Mean rewards of the policy on held-out prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvalResult {
    /// Policy version evaluated.
    pub step: u64,
    /// Completions scored.
    pub completions: usize,
    /// Mean weighted total.
    pub reward_mean: f64,
    /// Its spread.
    pub reward_std: f64,
    /// Per function.
    pub per_function: Vec<RewardStat>,
}

/// `eval/reward`, `eval/reward_std`, `eval/rewards/<name>/mean`, `eval/completions`.
impl crate::train::Scalars for EvalResult {
    const SECTION: &'static str = "eval";
    const RENAMES: &'static [(&'static str, &'static str)] = &[("reward_mean", "reward"), ("per_function", "rewards")];
    fn step(&self) -> u64 {
        self.step
    }
}

impl EvalResult {
    pub(super) fn from_batch(batch: &RolloutBatch, rewards: &[RewardFn], step: u64) -> Self {
        let totals: Vec<f64> = batch.totals().flatten().map(f64::from).collect();
        let (reward_mean, reward_std) = mean_std(&totals);
        EvalResult {
            step,
            completions: totals.len(),
            reward_mean,
            reward_std,
            per_function: reward_stats(batch, rewards),
        }
    }
}
