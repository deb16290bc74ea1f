//! The loss proper of a GRPO run ([`super::GrpoConfig::loss`]): TRL's `_compute_loss`
//! options for the clipped surrogate, its normalisation and the advantages, with their ranges.
//! The KL reference, the entropy bonus and the sampling correction are groups of their own
//! (`kl_reference.rs`, `entropy.rs`, `correction.rs`).

use super::super::{MultiObjective, ScaleRewards};
use crate::train::TrainError;

/// How the loss terms of a step are averaged (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum LossType {
    /// Over all loss terms of the step (token level; TRL's default).
    #[default]
    Dapo,
    /// Per rollout first, then over rollouts (the original GRPO; favours short completions).
    Grpo,
    /// Over rollouts x `max_completion_length` (Dr. GRPO: no length bias).
    DrGrpo,
    /// Over each micro-batch's terms (`per_device_train_batch_size` consecutive rollouts),
    /// then over micro-batches (TRL's `bnpo`; equal to `grpo` at one rollout per batch).
    Bnpo,
    /// CISPO (MiniMax-M1): `-min(ratio, epsilon_high)` (detached) x advantage x log-prob, so
    /// every token keeps a gradient; `epsilon_high` is the cap itself (ScaleRL recommends 5).
    /// Averaged as `dapo`.
    Cispo,
    /// SAPO: a soft gate `sigmoid(tau (ratio - 1)) x 4 / tau` instead of the hard clip, `tau`
    /// by the advantage's sign (`sapo_temperature_pos/neg`). Averaged as `grpo`.
    Sapo,
    /// LUSPO: the clipped surrogate summed over each rollout's tokens, then the mean over
    /// rollouts (length-unbiased with `importance_sampling_level = "sequence"`, as its paper).
    Luspo,
    /// VESPO: each rollout's importance weight `w` (the product over its tokens) shapes a
    /// detached Gamma weight `exp(lambda + k ln w - lambda w)` (1 at `w = 1`; `k`, `lambda`
    /// by the advantage's sign) times advantage x log-prob. Averaged as `dapo`.
    Vespo,
}

/// Where the importance ratio is taken (TRL's `importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ImportanceSampling {
    /// One ratio per token: `exp(logp - old_logp)` (GRPO; TRL's default).
    #[default]
    Token,
    /// One ratio per rollout, the exponent of its tokens' mean log-ratio, shared by all its
    /// tokens (GSPO: clipping then acts on whole sequences).
    Sequence,
}

/// The loss proper ([`GrpoConfig::loss`](super::GrpoConfig::loss)): TRL's `_compute_loss`
/// options for the clipped surrogate, how its terms are averaged, and how rewards become
/// advantages.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Loss {
    /// Lower clip of the importance ratio (TRL's `epsilon`, accepted as an alias).
    pub epsilon_low: f64,
    /// Upper clip of the importance ratio.
    pub epsilon_high: f64,
    /// Two-sided clipping: the unclipped branch's ratio is capped at `delta` too, so a large
    /// ratio with a negative advantage cannot blow the loss up (TRL's `delta`; above
    /// `1 + epsilon_high`; `None`: off).
    pub delta: Option<f64>,
    /// Token- or sequence-level importance ratios (GSPO).
    pub importance_sampling_level: ImportanceSampling,
    /// Train only the loss terms whose policy entropy is in the top `top_entropy_quantile` of
    /// the step's (TRL's ρ, "Beyond the 80/20 Rule"; 0.2 recommended, 1.0 keeps all). The other
    /// terms still count in the normaliser, as in TRL.
    pub top_entropy_quantile: f64,
    /// Advantage scaling within a group.
    pub scale_rewards: ScaleRewards,
    /// How several reward functions combine into one advantage (GDPO: `normalize_then_sum`).
    pub multi_objective_aggregation: MultiObjective,
    /// How loss terms are averaged.
    pub loss_type: LossType,
    /// Rollouts per micro-batch for `loss_type = "bnpo"` (TRL's `per_device_train_batch_size`,
    /// whose batches `bnpo` normalises over; packing itself is set by `token_budget`).
    pub per_device_train_batch_size: usize,
    /// Leave completions cut at `max_completion_length` out of the loss (TRL's
    /// `mask_truncated_completions`).
    pub mask_truncated_completions: bool,
    /// Optimizer steps taken on each generated batch (TRL's `num_iterations`, μ); the clip
    /// bounds how far later iterations move from the generating weights.
    pub num_iterations: usize,
    /// `sapo`'s gate temperature for terms with a positive advantage.
    pub sapo_temperature_pos: f64,
    /// `sapo`'s gate temperature for terms with a negative (or zero) advantage.
    pub sapo_temperature_neg: f64,
    /// `vespo`'s Gamma shape `k` for rollouts with an advantage >= 0.
    pub vespo_k_pos: f64,
    /// `vespo`'s Gamma rate `lambda` for rollouts with an advantage >= 0.
    pub vespo_lambda_pos: f64,
    /// `vespo`'s `k` for rollouts with a negative advantage.
    pub vespo_k_neg: f64,
    /// `vespo`'s `lambda` for rollouts with a negative advantage.
    pub vespo_lambda_neg: f64,
    /// Off-policy sequence masking (DeepSeek-V3.2, eq. 9): a rollout with a negative advantage
    /// whose mean per-token KL from the sampling weights to the policy (`sampled - policy`
    /// log-prob) exceeds this leaves the policy loss (`None`: off; e.g. 0.5).
    pub off_policy_mask_threshold: Option<f64>,
}

impl Default for Loss {
    fn default() -> Self {
        Loss {
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            importance_sampling_level: ImportanceSampling::Token,
            top_entropy_quantile: 1.0,
            scale_rewards: ScaleRewards::Group,
            multi_objective_aggregation: MultiObjective::SumThenNormalize,
            loss_type: LossType::Dapo,
            per_device_train_batch_size: 8,
            mask_truncated_completions: false,
            num_iterations: 1,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            off_policy_mask_threshold: None,
        }
    }
}

impl Loss {
    /// Ranges of the clipping, the loss types' shapes and the counts, naming the field.
    pub fn validate(&self) -> Result<(), TrainError> {
        let l = self;
        let positive = [
            ("num_iterations", l.num_iterations),
            ("per_device_train_batch_size", l.per_device_train_batch_size),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(TrainError::config(field, "must be at least 1"));
        }
        let non_negative = [
            ("epsilon_low", l.epsilon_low),
            ("epsilon_high", l.epsilon_high),
            ("vespo_k_pos", l.vespo_k_pos),
            ("vespo_lambda_pos", l.vespo_lambda_pos),
            ("vespo_k_neg", l.vespo_k_neg),
            ("vespo_lambda_neg", l.vespo_lambda_neg),
            ("off_policy_mask_threshold", l.off_policy_mask_threshold.unwrap_or(0.0)),
        ];
        if let Some((field, _)) = non_negative.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(TrainError::config(field, "must be finite and >= 0"));
        }
        let positive = [
            ("sapo_temperature_pos", l.sapo_temperature_pos),
            ("sapo_temperature_neg", l.sapo_temperature_neg),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            return Err(TrainError::config(field, "must be finite and > 0"));
        }
        if !(0.0..=1.0).contains(&l.top_entropy_quantile) {
            return Err(TrainError::config("top_entropy_quantile", "must lie in [0, 1]"));
        }
        if let Some(d) = l.delta.filter(|d| !(d.is_finite() && *d > 1.0 + l.epsilon_high)) {
            return Err(TrainError::config(
                "delta",
                format!("is {d}: it caps the unclipped ratio, so it must be finite and above 1 + epsilon_high"),
            ));
        }
        Ok(())
    }
}
