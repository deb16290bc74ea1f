//! The loss settings of a GRPO run ([`super::GrpoConfig::loss`]): TRL's `_compute_loss`
//! options, their ranges and the combinations TRL refuses.

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

/// How the mismatch between the weights that sampled a rollout and the policy at update start
/// is corrected (TRL's `vllm_importance_sampling_mode`; here for async rollouts and repeated
/// iterations, whose generating weights lag). The ratio is `exp(before - sampled)` of the
/// log-probs, per token or summed per rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum SamplingCorrectionMode {
    /// Per-token ratios clipped to `[clip_min, clip_max]`.
    TokenTruncate,
    /// Per-token ratios outside `[clip_min, clip_max]` set to 0.
    TokenMask,
    /// One ratio per rollout, clipped, applied to all its tokens.
    SequenceTruncate,
    /// Rollouts whose ratio is outside `[clip_min, clip_max]` left out (TRL 1.16's default).
    #[default]
    SequenceMask,
}

/// The loss ([`GrpoConfig::loss`](super::GrpoConfig::loss)): TRL's `_compute_loss` options.
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
    /// Correct for the weights that sampled the rollouts lagging the policy (TRL's
    /// `vllm_importance_sampling_correction`, accepted as an alias, as are its `_mode`,
    /// `_clip_max` (and `_cap`) and `_clip_min`): the clipped ratio is then taken against the
    /// policy's own log-probs at the start of the update (one more forward per row, without
    /// gradient), and each term's policy loss is weighted by the capped ratio of those to the
    /// sampling log-probs. Off by default (it costs that forward).
    pub importance_sampling_correction: bool,
    /// How the correction ratio is capped.
    pub importance_sampling_mode: SamplingCorrectionMode,
    /// Upper bound of the correction ratio (TRL's default 3.0; `None`: none).
    pub importance_sampling_clip_max: Option<f64>,
    /// Lower bound of the correction ratio (`None`: none).
    pub importance_sampling_clip_min: Option<f64>,
    /// Train only the loss terms whose policy entropy is in the top `top_entropy_quantile` of
    /// the step's (TRL's ρ, "Beyond the 80/20 Rule"; 0.2 recommended, 1.0 keeps all). The other
    /// terms still count in the normaliser, as in TRL.
    pub top_entropy_quantile: f64,
    /// KL penalty to the starting weights (0: off, no reference model is kept).
    pub beta: f64,
    /// Multiply each term's KL estimate by its importance ratio (token or sequence level, before
    /// any clipping; TRL's `use_bias_correction_kl`, from DeepSeek-V3.2): the tokens were sampled
    /// by the old weights, so the plain `k3` average is biased once the policy has moved. The
    /// corrected value is also what `ref_kl` reports. Used only with `beta > 0`; on by default,
    /// as in TRL 1.16.
    pub use_bias_correction_kl: bool,
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
    /// Turn dropout off for the run (TRL's `disable_dropout`): the decoder applies none, so this
    /// sets LoRA's `lora_dropout` to 0, and the log-probs of a rollout no longer depend on the
    /// dropout draws.
    pub disable_dropout: bool,
    /// TR-DPO: move the KL reference toward the policy every `ref_model_sync_steps` steps,
    /// `reference = alpha * policy + (1 - alpha) * reference` (needs `beta > 0`; with LoRA the
    /// reference is the base weights themselves, so it is refused, as TRL refuses it).
    pub sync_ref_model: bool,
    /// TR-DPO's alpha, in [0, 1].
    pub ref_model_mixup_alpha: f64,
    /// Steps between reference syncs.
    pub ref_model_sync_steps: u64,
    /// Entropy bonus: the loss minus this times the mean policy entropy over the step's trained
    /// terms (those above the entropy floor with `top_entropy_quantile`), whatever the loss
    /// type's normalisation. 0: off (and the LM head's logits are not kept for it).
    pub entropy_coef: f64,
    /// Skywork-OR1's adaptive coefficient: after each step `entropy_coef` moves by
    /// `entropy_coef_delta` (up while the step's entropy is at or below `entropy_target`, down
    /// otherwise, within `[entropy_coef_min, entropy_coef_max]`), and the bonus applies only
    /// while the last step's entropy was at or below the target. Checkpointed.
    pub use_adaptive_entropy: bool,
    /// Lowest adaptive coefficient.
    pub entropy_coef_min: f64,
    /// Highest adaptive coefficient.
    pub entropy_coef_max: f64,
    /// Step of the adaptive coefficient.
    pub entropy_coef_delta: f64,
    /// Entropy (nats per token) the adaptive coefficient steers toward.
    pub entropy_target: f64,
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
            importance_sampling_correction: false,
            importance_sampling_mode: SamplingCorrectionMode::SequenceMask,
            importance_sampling_clip_max: Some(3.0),
            importance_sampling_clip_min: None,
            top_entropy_quantile: 1.0,
            beta: 0.0,
            use_bias_correction_kl: true,
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
            disable_dropout: false,
            sync_ref_model: false,
            ref_model_mixup_alpha: 0.6,
            ref_model_sync_steps: 512,
            entropy_coef: 0.0,
            use_adaptive_entropy: false,
            entropy_coef_min: 0.0,
            entropy_coef_max: 1.0,
            entropy_coef_delta: 0.005,
            entropy_target: 0.2,
        }
    }
}

impl Loss {
    /// Ranges and the combinations TRL refuses, naming the field.
    pub(super) fn validate(&self) -> Result<(), TrainError> {
        let l = self;
        let non_negative = [
            ("epsilon_low", l.epsilon_low),
            ("epsilon_high", l.epsilon_high),
            ("beta", l.beta),
            ("vespo_k_pos", l.vespo_k_pos),
            ("vespo_lambda_pos", l.vespo_lambda_pos),
            ("vespo_k_neg", l.vespo_k_neg),
            ("vespo_lambda_neg", l.vespo_lambda_neg),
            ("off_policy_mask_threshold", l.off_policy_mask_threshold.unwrap_or(0.0)),
        ];
        if let Some((field, _)) = non_negative.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(TrainError::config(field, "must be finite and >= 0"));
        }
        let finite = [("entropy_coef", l.entropy_coef), ("entropy_target", l.entropy_target)];
        if let Some((field, _)) = finite.iter().find(|(_, v)| !v.is_finite()) {
            return Err(TrainError::config(field, "must be finite"));
        }
        if l.use_adaptive_entropy
            && !(l.entropy_coef_min.is_finite()
                && l.entropy_coef_max.is_finite()
                && l.entropy_coef_min <= l.entropy_coef_max
                && l.entropy_coef_delta.is_finite()
                && l.entropy_coef_delta >= 0.0)
        {
            return Err(TrainError::config(
                "entropy_coef_min",
                "entropy_coef_min <= entropy_coef_max and entropy_coef_delta >= 0, all finite, for use_adaptive_entropy",
            ));
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
        if l.sync_ref_model && l.beta == 0.0 {
            return Err(TrainError::config(
                "sync_ref_model",
                "needs beta > 0: without the KL term there is no reference to sync",
            ));
        }
        if !(0.0..=1.0).contains(&l.ref_model_mixup_alpha) || l.ref_model_sync_steps == 0 {
            return Err(TrainError::config(
                "ref_model_mixup_alpha",
                "must lie in [0, 1], with ref_model_sync_steps >= 1",
            ));
        }
        // VESPO folds the correction into its sequence weight token by token (as TRL does).
        let per_sequence = matches!(
            l.importance_sampling_mode,
            SamplingCorrectionMode::SequenceMask | SamplingCorrectionMode::SequenceTruncate
        );
        if l.loss_type == LossType::Vespo && l.importance_sampling_correction && per_sequence {
            return Err(TrainError::config(
                "importance_sampling_mode",
                "must be token_truncate or token_mask with loss_type = \"vespo\" and importance_sampling_correction (TRL refuses the sequence modes)",
            ));
        }
        Ok(())
    }
}
